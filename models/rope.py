"""Rotary position embedding: rotate-half RoPE over the first `rotary_dim` dims of each head (the rest pass through),
cos and sin scaled by the setting's attention scaling (YaRN), as transformers applies it; and the maths of each rope
type's frequencies (`inv_freq`: default, linear, llama3, YaRN) from a parsed `netra_jax.config.RopeConfig`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.config import RopeConfig

__all__ = ["attention_scaling", "inv_freq", "rope", "rope_tables"]


def rope_tables(positions: jax.Array, rc: RopeConfig, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, rotary_dim // 2] float32 of each position's angles, times the attention scaling."""
    freq = jnp.asarray(np.asarray(inv_freq(rc, rotary_dim), np.float32))  # [half], a trace-time constant
    ang = positions.astype(jnp.float32)[:, None] * freq[None, :]  # [T, half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    scaling = attention_scaling(rc)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
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


def inv_freq(rc: RopeConfig, rotary_dim: int) -> list[float]:
    """Inverse frequencies (length rotary_dim // 2) of the rotated dims, following the rope type's scaling."""
    base = [1.0 / (rc.theta ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)]
    if rc.rope_type == "default":
        return base
    if rc.rope_type == "linear":
        return [f / rc.factor for f in base]
    if rc.rope_type == "yarn":
        return _yarn_inv_freq(rc, base, rotary_dim)
    # llama3: scale low frequencies, keep high ones, interpolate between
    old = rc.original_max_position_embeddings
    low_wl, high_wl = old / rc.low_freq_factor, old / rc.high_freq_factor
    out = []
    for f in base:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / rc.factor)
        else:
            s = (old / wl - rc.low_freq_factor) / (rc.high_freq_factor - rc.low_freq_factor)
            out.append((1 - s) * f / rc.factor + s * f)
    return out


def _yarn_inv_freq(rc: RopeConfig, base: list[float], rotary_dim: int) -> list[float]:
    """YaRN (NTK-by-parts): dims turning more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are divided by `factor`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        wavelength = rc.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelength) / (2 * math.log(rc.theta))

    low, high = correction_dim(rc.beta_fast), correction_dim(rc.beta_slow)
    if rc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    out = []
    for i, f in enumerate(base):
        interpolate = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep f, 1: f / factor
        out.append(f / rc.factor * interpolate + f * (1 - interpolate))
    return out


def attention_scaling(rc: RopeConfig) -> float:
    """Scale of cos and sin (so of q.k by its square): YaRN's attention factor, 1 for the other types."""
    if rc.rope_type != "yarn":
        return 1.0
    if rc.attention_factor is not None:
        return rc.attention_factor
    if rc.mscale and rc.mscale_all_dim:
        return _yarn_mscale(rc.factor, rc.mscale) / _yarn_mscale(rc.factor, rc.mscale_all_dim)
    return _yarn_mscale(rc.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
