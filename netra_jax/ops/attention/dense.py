"""The fixed-shape, loop-free jnp attention whose VJP is every backend's backward.

`attention` is reverse-mode differentiable on every backend, with respect to q, the K/V pages and
the sinks. Its forward is the selected backend's call unchanged (a jit without differentiation compiles exactly the
backend); its backward is the VJP of `paged_attention_dense`, a fixed-shape jnp reference of the same attention (the
reference's dynamic-length loops and the Pallas kernels have no backward of their own). The backward's memory is
dense: per call, each token's whole block table of keys and values gathered in float32, [T, max_pages * page_size,
kv_heads, head_dim] each (once, without the T, for a batch of one sequence), and its scores and probabilities
[T, q_heads, max_pages * page_size] float32, so it suits training-style use (short sequences, small block tables),
not serving-size batches. Forward-mode (jvp) is not provided."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops.attention.metadata import AttentionMetadata, with_token_layout
from netra_jax.ops.attention.reference import masked_scores
from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.kv_quant import Pages, take_pages


def paged_attention_dense(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention with fixed shapes and no loops: the differentiable reference `attention`'s backward
    is the VJP of. Same arguments, masks (causal, sliding window, soft-cap, sinks) and result as
    `paged_attention_reference`; `md.work` is ignored.

    Every token gathers its sequence's whole block table: keys and values [T, max_pages * page_size, kv_heads,
    head_dim] float32 (once, [max_pages * page_size, kv_heads, head_dim], when the batch is one sequence, as
    `models.transformer.forward_dense`'s), scores [T, q_heads, max_pages * page_size] float32: memory grows with T
    times the block table's width (see the module docstring). Differentiable (reverse and forward mode) in q,
    k_pages, v_pages and sinks (quantized pages: in q and sinks only); softmax in float32.
    """
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    lay = with_token_layout(md, T).layout
    K = lay.rows.shape[1] * P  # keys of a whole block table
    one = md.block_tables.shape[0] == 1  # one sequence: every token's keys are the same, gathered once
    rows, keys = (md.block_tables[0], "ckd") if one else (lay.rows, "tckd")  # [(T,) max_pages]

    def gather(pages):  # [(T,) K, KH, D] float32: the (each token's) sequence's keys or values in position order
        return take_pages(pages, rows).reshape(*rows.shape[:-1], K, KH, D)  # de-quantized if the cache is

    qg = q.astype(jnp.float32).reshape(T, KH, G, D) * scale
    s = jnp.einsum(f"tkgd,{keys}->tkgc", qg, gather(k_pages), precision=jax.lax.Precision.HIGHEST)  # [T, KH, G, K]
    qpos = jnp.where(lay.valid, lay.q_pos, -1)[:, None, None, None]  # padding tokens see no key
    s, mask = masked_scores(s, jnp.arange(K, dtype=jnp.int32), qpos, sliding_window, soft_cap)
    m = s.max(-1)  # [T, KH, G]
    if sinks is not None:
        sk = jnp.broadcast_to(sinks.reshape(KH, G), m.shape)  # [T, KH, G]
        m = jnp.maximum(m, sk)
    m = jax.lax.stop_gradient(m)  # the softmax does not depend on it
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)  # [T, KH, G, K]
    l = p.sum(-1) if sinks is None else p.sum(-1) + jnp.exp(sk - m)
    o = jnp.einsum(f"tkgc,{keys}->tkgd", p, gather(v_pages), precision=jax.lax.Precision.HIGHEST)  # [T, KH, G, D]
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return o.reshape(T, H, D).astype(q.dtype)
