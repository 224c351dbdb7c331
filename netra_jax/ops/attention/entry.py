"""The one attention entry point: `attention` runs the selected backend forward and differentiates it as
`paged_attention_dense` (see `netra_jax.ops.attention.dense`)."""

from __future__ import annotations

import functools

import jax

from netra_jax.ops.attention.dense import paged_attention_dense
from netra_jax.ops.attention.metadata import AttentionMetadata
from netra_jax.ops.attention.registry import BACKENDS
from netra_jax.ops.kv_quant import Pages


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    """`backend`'s attention, differentiated as `paged_attention_dense`. backend: the BACKENDS key (static)."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return BACKENDS[backend](q, k_pages, v_pages, md, **kw)


def _with_dense_vjp_fwd(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    out = _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)
    return out, (q, k_pages, v_pages, md, sinks)


def _with_dense_vjp_bwd(backend, scale, sliding_window, soft_cap, res, g):
    q, k_pages, v_pages, md, sinks = res

    def dense(q, k_pages, v_pages, sinks):
        kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        return paged_attention_dense(q, k_pages, v_pages, md, **kw)

    _, vjp = jax.vjp(dense, q, k_pages, v_pages, sinks)
    dq, dk, dv, dsinks = vjp(g)
    return dq, dk, dv, None, dsinks  # the integer metadata has no cotangent


_with_dense_vjp.defvjp(_with_dense_vjp_fwd, _with_dense_vjp_bwd)


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

    Reverse-mode differentiable on every backend with respect to q, k_pages, v_pages and sinks (zero for the
    metadata): the forward is the backend's, the backward `paged_attention_dense`'s (see the module docstring for
    its memory cost).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)
