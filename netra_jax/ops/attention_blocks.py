"""Query blocks of a ragged token batch for the Mosaic GPU attention kernel: each block holds up to `bq` tokens of
one sequence (the Triton kernel's `_block_layout`), laid out as rows t * G + g (token t, query head g of a KV group).

Sequence s owns blocks first_block[s] = qsl[s] // bq + s onwards, so T // bq + S blocks cover any batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops.paged_attention_triton import _block_layout


def block_layout(md, num_tokens: int, bq: int):
    """(sequence, first flat token, tokens (0 = idle block), position of the first token): int32 [num_blocks] each."""
    return _block_layout(md.query_start_loc, md.seq_lens, num_tokens, bq)


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
    s_of = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right").astype(jnp.int32), 0, S - 1)  # [T]
    local = t - qsl[s_of]
    blk = jnp.clip(qsl[s_of] // bq + s_of + local // bq, 0, num_blocks - 1)[:, None, None]  # [T, 1, 1]
    row = ((local % bq) * group)[:, None, None] + jnp.arange(group)[None, None, :]  # [T, 1, G]
    return blk, row


__all__ = ["block_layout", "gather_block_rows", "token_rows"]
