"""Argument checks shared by every attention backend (the jnp reference and the Pallas kernels), so each backend
refuses the same bad shapes with the same message."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_attention_args(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    sliding_window: int | None,
    sinks: jax.Array | None,
) -> jax.Array | None:
    """Validate one attention call; returns the sinks as float32 [q_heads] (or None).

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; sinks: [q_heads]."""
    H, D = q.shape[1], q.shape[2]
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[3] != D:
        raise ValueError(f"shape mismatch: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if H % k_pages.shape[2]:
        raise ValueError(f"q_heads={H} is not a multiple of kv_heads={k_pages.shape[2]}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if sinks is None:
        return None
    if sinks.shape != (H,):
        raise ValueError(f"sinks must have shape ({H},) (one logit per query head), got {sinks.shape}")
    return sinks.astype(jnp.float32)
