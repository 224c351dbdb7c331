"""The per-step description of a ragged token batch that every attention backend reads: the metadata the runner
builds, the host-built split of its tokens between the reference's two paths, and the per-token layout."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TokenLayout:
    """Per-token view of a step's ragged batch, derived once per step and shared by every layer."""

    seq_idx: jax.Array  # [T] int32 sequence of each token (clamped into range for padding tokens)
    q_pos: jax.Array  # [T] int32 absolute position of each token (0 for padding)
    valid: jax.Array  # [T] bool real (non-padding) token
    rows: jax.Array  # [T, max_pages] int32 block-table row of each token's sequence


@flax.struct.dataclass
class AttentionWork:
    """Host-built split of a step's tokens between the reference's two paths. N = num_items(T, S)."""

    tokens: jax.Array  # [T] int32 tokens of single-token (decode) sequences first, the rest padded with T
    num_tokens: jax.Array  # [] int32 how many entries of `tokens` are real
    item_start: jax.Array  # [N] int32 first token of each query block (runs of <= _QUERY_BLOCK tokens of one seq)
    item_len: jax.Array  # [N] int32 tokens in the block (0 for padding items, which come last)
    item_seq: jax.Array  # [N] int32 the block's sequence
    num_items: jax.Array  # [] int32 real items


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch. T = padded token count, S = padded sequence count."""

    slot_mapping: jax.Array  # [T] int32 flat KV slot (page * page_size + offset) for each new token; padding >= slots
    query_start_loc: jax.Array  # [S + 1] int32 cumulative query lengths; padding sequences have length 0
    seq_lens: jax.Array  # [S] int32 context length of each sequence after this step (cached + new); 0 for padding
    block_tables: jax.Array  # [S, max_pages] int32 page ids of each sequence; unused entries 0
    layout: TokenLayout | None = None  # filled by `with_token_layout`; the reference derives it when absent
    work: AttentionWork | None = None  # host-built path split (reference only); absent: every token per token


def token_layout(md: AttentionMetadata, num_tokens: int):
    """Derive each token's sequence index and absolute position from the metadata.

    Returns (seq_idx [T] int32, q_pos [T] int32, valid [T] bool)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = md.query_start_loc
    # an unrolled binary search (the default is a while loop: see attention_blocks.token_rows)
    seq_idx = jnp.searchsorted(qsl[1:], t, side="right", method="scan_unrolled").astype(jnp.int32)
    valid = t < qsl[-1]
    seq_idx = jnp.minimum(seq_idx, md.seq_lens.shape[0] - 1)
    q_len = qsl[seq_idx + 1] - qsl[seq_idx]
    q_pos = md.seq_lens[seq_idx] - q_len + (t - qsl[seq_idx])
    return seq_idx, jnp.where(valid, q_pos, 0), valid


def with_token_layout(md: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """md with its per-token layout computed (once per step, instead of once per layer)."""
    if md.layout is not None:
        return md
    seq_idx, q_pos, valid = token_layout(md, num_tokens)
    return md.replace(layout=TokenLayout(seq_idx, q_pos, valid, md.block_tables[seq_idx]))
