"""What the Pallas attention kernels (Triton and Mosaic GPU) share: query blocks of a ragged token batch (each up to
`bq` tokens of one sequence, rows t * G + g for token t and query head g of a KV group), and the split-K merge.

Sequence s owns blocks first_block[s] = qsl[s] // bq + s onwards, so T // bq + S blocks cover any batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Programs wanted in flight before split-K stops paying: about two waves on a 132-SM H200 / H100.
TARGET_PROGRAMS = 264
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp2 is the cheaper instruction


def block_layout(query_start_loc: jax.Array, seq_lens: jax.Array, num_tokens: int, block_q: int):
    """Map a static number of query blocks onto the ragged batch; each block holds tokens of one sequence only.

    Sequence s owns blocks [qsl[s] // block_q + s, ...): at least cdiv(q_len, block_q) of them, so
    num_blocks = T // block_q + S covers every batch. Returns int32 arrays [num_blocks] of (sequence index,
    first flat token, number of valid tokens (0 = idle block), absolute position of the first token)."""
    S = seq_lens.shape[0]
    num_blocks = num_tokens // block_q + S
    qsl = query_start_loc.astype(jnp.int32)  # [S + 1]
    q_len = qsl[1:] - qsl[:-1]  # [S]
    first_block = qsl[:-1] // block_q + jnp.arange(S, dtype=jnp.int32)  # [S] strictly increasing
    b = jnp.arange(num_blocks, dtype=jnp.int32)  # [NB]
    method = "compare_all" if num_blocks * S <= (1 << 22) else "sort"  # one fusion instead of a loop on GPU
    seq = jnp.searchsorted(first_block, b, side="right", method=method).astype(jnp.int32)  # [NB]
    seq = jnp.clip(seq - 1, 0, S - 1)
    local = b - first_block[seq]  # [NB] block index within its sequence
    n_q = jnp.clip(q_len[seq] - local * block_q, 0, block_q)  # [NB]
    q_start = qsl[seq] + local * block_q  # [NB]
    pos0 = seq_lens[seq].astype(jnp.int32) - q_len[seq] + local * block_q  # [NB]
    return seq, q_start, n_q, pos0


def merge_splits(acc: jax.Array, m: jax.Array, den: jax.Array) -> jax.Array:
    """Combine split-K partials. acc: [NS, ...rows, Dp] unnormalised; m, den: [NS, ...rows]. Returns [...rows, Dp]."""
    m_max = jnp.max(m, axis=0)  # [...rows]
    w = jnp.exp2(m - jnp.where(jnp.isfinite(m_max), m_max, 0.0)[None])  # [NS, ...rows] (m is base 2)
    w = jnp.where(jnp.isfinite(m), w, 0.0)
    l_tot = jnp.sum(w * den, axis=0)  # [...rows]
    o = jnp.sum(w[..., None] * acc, axis=0)  # [..., Dp]
    return jnp.where(l_tot[..., None] > 0, o / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)


def gather_block_rows(q: jax.Array, q_start: jax.Array, n_q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """The query rows of every block: [NB, kv_heads, rows, D], row t * G + g = head kh * G + g of token
    q_start[b] + t; rows of absent tokens (and past bq * G) are zeros. q: [T, q_heads, D]; q_start, n_q: [NB]."""
    T, H, D = q.shape
    G = H // kv_heads
    bq = rows // G
    t_in = jnp.arange(bq, dtype=jnp.int32)
    tok = jnp.clip(q_start[:, None] + t_in[None, :], 0, T - 1)  # [NB, bq]
    live = (t_in[None, :] < n_q[:, None])[..., None, None, None]  # [NB, bq, 1, 1, 1]
    out = jnp.where(live, q.reshape(T, kv_heads, G, D)[tok], 0)  # [NB, bq, KH, G, D]
    out = out.transpose(0, 2, 1, 3, 4).reshape(q_start.shape[0], kv_heads, bq * G, D)
    return jnp.pad(out, ((0, 0), (0, 0), (0, rows - bq * G), (0, 0)))


def token_rows(query_start_loc: jax.Array, num_tokens: int, num_blocks: int, bq: int, group: int):
    """Where each token's rows are: (block [T, 1, 1], row [T, 1, G]) index arrays, broadcasting with a KV-head index
    [1, KH, 1] to [T, KH, G]. Token t of sequence s sits in block first_block[s] + local // bq, rows
    (local % bq) * G + g, local = t - qsl[s]. Tokens past the batch point at some block (mask them)."""
    S = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = query_start_loc.astype(jnp.int32)
    # an unrolled binary search: the default ("scan") is a while loop, which the GPU runs from the host between two
    # CUDA graphs (its condition read back every iteration)
    s_of = jnp.searchsorted(qsl[1:], t, side="right", method="scan_unrolled").astype(jnp.int32)
    s_of = jnp.clip(s_of, 0, S - 1)  # [T]
    local = t - qsl[s_of]
    blk = jnp.clip(qsl[s_of] // bq + s_of + local // bq, 0, num_blocks - 1)[:, None, None]  # [T, 1, 1]
    row = ((local % bq) * group)[:, None, None] + jnp.arange(group)[None, None, :]  # [T, 1, G]
    return blk, row


__all__ = ["LOG2E", "TARGET_PROGRAMS", "block_layout", "gather_block_rows", "merge_splits", "token_rows"]
