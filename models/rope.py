"""Rotary position embedding: rotate-half RoPE over the first `rotary_dim` dims of each head (the rest pass through),
cos and sin scaled by the setting's attention scaling (YaRN), as transformers applies it. Frequencies: `RopeConfig`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.config import RopeConfig

__all__ = ["rope", "rope_tables"]


def rope_tables(positions: jax.Array, rc: RopeConfig, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, rotary_dim // 2] float32 of each position's angles, times the attention scaling."""
    inv_freq = jnp.asarray(np.asarray(rc.inv_freq(rotary_dim), np.float32))  # [half], a trace-time constant
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if rc.attention_scaling != 1.0:
        cos, sin = cos * rc.attention_scaling, sin * rc.attention_scaling
    return cos, sin


def rope(x: jax.Array, positions: jax.Array, rc: RopeConfig, rotary_dim: int) -> jax.Array:
    """x: [T, heads, head_dim]; positions: [T]; rotary_dim: even, at most head_dim. Returns x's shape and dtype."""
    head_dim = x.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim = {head_dim}]")
    half = rotary_dim // 2
    cos, sin = rope_tables(positions, rc, rotary_dim)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]  # [T, heads, half] each
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < head_dim:
        rotated.append(xf[..., rotary_dim:])  # [T, heads, head_dim - rotary_dim], unchanged
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)
