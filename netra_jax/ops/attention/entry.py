"""The one attention entry point: `attention` runs the selected backend forward and differentiates it as
`paged_attention_dense` (see `netra_jax.ops.attention.dense`)."""

from __future__ import annotations

import functools

import jax

from netra_jax.ops.attention.dense import paged_attention_dense
from netra_jax.ops.attention.metadata import AttentionMetadata
from netra_jax.ops.attention.registry import BACKENDS
from netra_jax.ops.kv_quant import Pages


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _with_dense_jvp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    """`backend`'s attention, differentiated as `paged_attention_dense`. backend: the BACKENDS key (static)."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return BACKENDS[backend](q, k_pages, v_pages, md, **kw)


@functools.partial(jax.checkpoint, static_argnums=(0, 1, 2))
def _dense(scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    """`paged_attention_dense`, rematerialized: reverse mode (which linearizes and transposes the JVP below) keeps
    only these inputs from the forward pass and recomputes the scores in the backward, as a VJP rule would."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return paged_attention_dense(q, k_pages, v_pages, md, **kw)


@_with_dense_jvp.defjvp
def _with_dense_jvp_rule(backend, scale, sliding_window, soft_cap, primals, tangents):
    """The backend's output (through `_with_dense_jvp` again, so that higher orders land here too) and the dense
    reference's tangent, the metadata held fixed (integer: no tangent)."""
    q, k_pages, v_pages, md, sinks = primals
    dq, dk, dv, _, dsinks = tangents

    def dense(q, k_pages, v_pages, sinks):
        return _dense(scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)

    _, tangent = jax.jvp(dense, (q, k_pages, v_pages, sinks), (dq, dk, dv, dsinks))
    return _with_dense_jvp(backend, scale, sliding_window, soft_cap, *primals), tangent


def attention(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    backend: str = "reference",
) -> jax.Array:
    """Ragged paged attention through the selected backend (see `BACKENDS`). Shapes as in the reference.

    Differentiable on every backend, forward mode (`jax.jvp`, `jax.linearize`, `jax.jacfwd`) and reverse mode
    (`jax.grad`, `jax.vjp`) to any order, with respect to q, k_pages, v_pages and sinks (zero for the metadata): the
    forward is the backend's, the derivatives `paged_attention_dense`'s (see the module docstring for their memory
    cost).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return _with_dense_jvp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)
