"""The metadata of a ragged token batch over a paged KV cache, built on the host from each sequence's lengths and
block table: positions, slot mapping, attention metadata and work lists (`build_batch`). `netra_jax.paged` is their
public face, with the cache itself and a worked example."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops.attention import AttentionMetadata, AttentionWork, build_work

__all__ = ["PagedBatch", "build_batch", "flat_tokens", "padding_slot", "token_slots"]


class PagedBatch(NamedTuple):
    """What `forward` takes besides the parameters, the token ids and the cache."""

    positions: jax.Array  # [T] int32 position of each new token in its sequence (padding: 0)
    metadata: AttentionMetadata  # slot mapping, query_start_loc, seq_lens, block tables and attention work lists
    last_token_indices: jax.Array  # [S] int32 row of each sequence's last new token (padding sequences: 0)
    num_tokens: int  # real (not padding) tokens


def padding_slot(num_pages: int, page_size: int) -> int:
    """The KV slot padding tokens write to: one past the cache's last slot, so the write drops them."""
    return num_pages * page_size


def token_slots(block_table: Sequence[int] | np.ndarray, start: int, stop: int, page_size: int) -> np.ndarray:
    """Flat KV slots (page * page_size + offset) of a sequence's positions [start, stop): [stop - start] int32."""
    blocks = np.asarray(block_table, np.int32)
    p = np.arange(start, stop, dtype=np.int32)
    return blocks[p // page_size] * page_size + p % page_size


def build_batch(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    page_size: int,
    num_pages: int,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_pages: int | None = None,
) -> PagedBatch:
    """Positions and attention metadata of one ragged batch (`netra_jax.paged` describes the layout).

    Args:
        seq_lens: Per sequence, its context length after this call: tokens already cached plus new ones.
        query_lens: Per sequence, its new tokens (at least 1, at most its seq_len), laid out in this order.
        block_tables: Per sequence, its page ids in order; at least ceil(seq_len / page_size) of them.
        page_size: Tokens per page of the cache.
        num_pages: Pages in the cache (page ids are below it; the padding slot is past its last slot).
        num_tokens: Pad the batch to this many tokens (None: the real count).
        num_seqs: Pad to this many sequences, of no tokens (None: the real count).
        max_pages: Width of the block-table array (None: the longest table).

    Returns:
        A PagedBatch: positions [T], AttentionMetadata and the last token row of each sequence [S].

    Raises:
        ValueError: Lengths that disagree, a block table too short for its sequence or naming a page outside the
            cache, or more tokens, sequences or pages than the padded sizes.
    """
    n = len(seq_lens)
    if not n or len(query_lens) != n or len(block_tables) != n:
        raise ValueError(
            f"need one seq_len, query_len and block table per sequence (at least one), got {len(seq_lens)}, "
            f"{len(query_lens)} and {len(block_tables)}"
        )
    if page_size < 1 or num_pages < 1:
        raise ValueError(f"page_size and num_pages must be positive, got {page_size} and {num_pages}")
    tables = [np.asarray(t, np.int32).reshape(-1) for t in block_tables]
    for s, (L, q, t) in enumerate(zip(seq_lens, query_lens, tables, strict=True)):
        if not 1 <= q <= L:
            raise ValueError(f"sequence {s}: query_len {q} must be in [1, seq_len {L}]")
        if len(t) * page_size < L:
            raise ValueError(f"sequence {s}: {len(t)} pages of {page_size} cannot hold its {L} tokens")
        if len(t) and (t.min() < 0 or t.max() >= num_pages):
            raise ValueError(f"sequence {s}: block table names a page outside [0, {num_pages})")
    total = int(sum(query_lens))
    T = total if num_tokens is None else num_tokens
    S = n if num_seqs is None else num_seqs
    W = max(len(t) for t in tables) if max_pages is None else max_pages
    if T < total or S < n or W < max(len(t) for t in tables):
        raise ValueError(
            f"{total} tokens, {n} sequences and tables of up to {max(len(t) for t in tables)} pages do not fit "
            f"num_tokens={T}, num_seqs={S}, max_pages={W}"
        )
    positions = np.zeros(T, np.int32)
    slots = np.full(T, padding_slot(num_pages, page_size), np.int32)
    qsl = np.zeros(S + 1, np.int32)
    lens = np.zeros(S, np.int32)
    last = np.zeros(S, np.int32)
    bt = np.zeros((S, W), np.int32)
    t = 0
    for s, (L, q, table) in enumerate(zip(seq_lens, query_lens, tables, strict=True)):
        positions[t : t + q] = np.arange(L - q, L, dtype=np.int32)
        slots[t : t + q] = token_slots(table, L - q, L, page_size)
        bt[s, : len(table)] = table
        lens[s] = L
        t += q
        qsl[s + 1] = t
        last[s] = t - 1
    qsl[n + 1 :] = t
    work = AttentionWork(*(jnp.asarray(a) for a in build_work(list(query_lens), T, S)))
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(lens),
        block_tables=jnp.asarray(bt),
        work=work,
    )
    return PagedBatch(jnp.asarray(positions), md, jnp.asarray(last), total)


def flat_tokens(token_ids: Sequence[Sequence[int]], num_tokens: int | None = None) -> jax.Array:
    """Each sequence's new token ids back to back, zero-padded to `num_tokens`: [T] int32."""
    flat = [int(i) for ids in token_ids for i in ids]
    T = len(flat) if num_tokens is None else num_tokens
    if T < len(flat):
        raise ValueError(f"{len(flat)} tokens do not fit num_tokens={T}")
    out = np.zeros(T, np.int32)
    out[: len(flat)] = flat
    return jnp.asarray(out)
