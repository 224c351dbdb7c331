"""The fixed-shape, loop-free jnp attention whose derivatives are every backend's.

`attention` is differentiable on every backend, in forward mode (`jax.jvp`, `jax.linearize`, `jax.jacfwd`) and
reverse mode (`jax.grad`, `jax.vjp`), to any order, with respect to q, the K/V pages and the sinks. Its forward is
the selected backend's call unchanged (a jit without differentiation compiles exactly the backend); its tangent is
the JVP of `paged_attention_dense`, a fixed-shape jnp reference of the same attention (the reference's
dynamic-length loops and the Pallas kernels have no derivative of their own), and jax derives the backward by
transposing that tangent, the reference rematerialized so that the forward pass keeps only its inputs. The
derivatives' memory is dense: per call, each token's whole block table of keys and values gathered in float32,
[T, max_pages * page_size, kv_heads, head_dim] each (once, without the T, for a batch of one sequence), and its
scores and probabilities [T, q_heads, max_pages * page_size] float32, so they suit training-style use (short
sequences, small block tables), not serving-size batches."""

from __future__ import annotations

import jax

from netra_jax.ops.attention.metadata import AttentionMetadata
from netra_jax.ops.attention.pattern import attend_probs, attention_probs
from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.kv_quant import Pages


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
    """Ragged paged attention with fixed shapes and no loops: the differentiable reference whose derivatives are
    `attention`'s. Same arguments, masks (causal, sliding window, soft-cap, sinks) and result as
    `paged_attention_reference`; `md.work` is ignored.

    Every token gathers its sequence's whole block table: keys and values [T, max_pages * page_size, kv_heads,
    head_dim] float32 (once, [max_pages * page_size, kv_heads, head_dim], when the batch is one sequence, as
    `models.transformer.forward_dense`'s), scores [T, q_heads, max_pages * page_size] float32: memory grows with T
    times the block table's width (see the module docstring). Differentiable (reverse and forward mode) in q,
    k_pages, v_pages and sinks (quantized pages: in q and sinks only); softmax in float32. The probabilities are
    `netra_jax.ops.attention.pattern`'s, the `pattern` hook point's.
    """
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    probs = attention_probs(q, k_pages, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return attend_probs(probs, v_pages, md).astype(q.dtype)  # [T, q_heads, head_dim]
