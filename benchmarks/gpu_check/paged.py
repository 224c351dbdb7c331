"""Paged-attention inputs and baselines shared by the correctness and attention sections: a random ragged batch
with its pages scattered over the cache, the GPU backends to check (or why one is missing), and XLA dense attention
over the gathered pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops.attention import BACKENDS, AttentionMetadata
from netra_jax.ops.paged_attention_mosaic import supports

# GPU backend -> the same kernel through its interpreter (what the CPU dry run calls)
GPU_BACKENDS = {"mosaic": "mosaic_interpret", "triton": "triton_interpret"}


def backend_name(name: str, dry: bool) -> str:
    return GPU_BACKENDS[name] if dry else name


def backend(name: str, dry: bool):
    """The attention function of a GPU backend (its interpreter in the dry run)."""
    return BACKENDS[backend_name(name, dry)]


def unsupported(name: str, dtype, heads: int, kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """The reason a backend refuses these shapes up front (the Mosaic kernel's `supports`; q and KV in one dtype)."""
    if name != "mosaic":
        return None
    return supports(dtype, dtype, heads, kv_heads, head_dim, page_size)


def make_batch(seqs, *, heads, kv_heads, head_dim, page_size, dtype, seed=0, copies=1):
    """A ragged step. seqs: [(cached tokens, new tokens)] per sequence. Returns (q, [(k_pages, v_pages)] * copies,
    md, q_lens, seq_lens): `copies` independent caches of the same layout (benchmarks rotate through them so the
    KV reads do not come from L2). Pages are a random permutation; slots nobody reads hold random values too."""
    rng = np.random.default_rng(seed)
    q_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    need = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(need) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = np.zeros((len(seqs), max(need)), np.int32)
    i = 0
    for s, n in enumerate(need):
        bt[s, :n] = perm[i : i + n]
        i += n
    T = sum(q_lens)
    md = AttentionMetadata(
        slot_mapping=jnp.full((T,), num_pages * page_size, jnp.int32),  # not used by attention
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        seq_lens=jnp.asarray(np.array(seq_lens, np.int32)),
        block_tables=jnp.asarray(bt),
    )
    keys = jax.random.split(jax.random.key(seed), 1 + 2 * copies)
    q = jax.random.normal(keys[0], (T, heads, head_dim), dtype)
    shape = (num_pages, page_size, kv_heads, head_dim)
    caches = [
        (jax.random.normal(keys[1 + 2 * c], shape, dtype), jax.random.normal(keys[2 + 2 * c], shape, dtype))
        for c in range(copies)
    ]
    return q, caches, md, q_lens, seq_lens


def dense_attention(q, k_pages, v_pages, md, *, scale, q_len: int, context: int):
    """XLA over gathered pages for a batch whose sequences all have `q_len` new tokens and `context` tokens in all:
    gather each sequence's pages into a dense [B, context, kv_heads, D] K and V, then `jax.nn.dot_product_attention`
    (causal within the new tokens, GQA by head groups). q: [B * q_len, H, D]."""
    B = md.block_tables.shape[0]
    _, P, KH, D = k_pages.shape
    n_pages = -(-context // P)
    rows = md.block_tables[:, :n_pages]  # [B, n_pages]
    k = k_pages[rows].reshape(B, n_pages * P, KH, D)[:, :context]  # [B, context, KH, D]
    v = v_pages[rows].reshape(B, n_pages * P, KH, D)[:, :context]
    qb = q.reshape(B, q_len, q.shape[1], D)  # [B, q_len, H, D]
    mask = None
    if q_len > 1:  # query j sits at position context - q_len + j
        qpos = context - q_len + jnp.arange(q_len)[:, None]
        mask = (jnp.arange(context)[None, :] <= qpos)[None, None]  # [1, 1, q_len, context]
    out = jax.nn.dot_product_attention(qb, k, v, mask=mask, scale=scale, implementation="xla")
    return out.reshape(q.shape)
