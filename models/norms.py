"""The model's normalizations and MLP activations, on float32 internally: RMSNorm, LayerNorm, the config-chosen
norm of a parameter dict, and the activations by name; optionally summed in a fixed order (batch-invariant)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.config import ModelConfig
from netra_jax.ops.invariant import tree_mean
from netra_jax.quant import ROW_INVARIANT


def _mean(x: jax.Array, invariant: bool) -> jax.Array:
    """The mean over the last axis, keeping it: XLA's reduce, or (invariant) summed in a fixed order."""
    return tree_mean(x)[..., None] if invariant else jnp.mean(x, axis=-1, keepdims=True)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, invariant: bool = False) -> jax.Array:
    """RMSNorm in float32, result in x's dtype. x: [..., dim]; w: [dim]. invariant: sum in a fixed order
    (`netra_jax.ops.invariant`; the batch-invariant backends), so a row's result never depends on the other rows."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(_mean(xf * xf, invariant) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array | None, eps: float, invariant: bool = False) -> jax.Array:
    """LayerNorm in float32 (centred, divided by the standard deviation, times w plus b), result in x's dtype.
    x: [..., dim]; w, b: [dim] (b None: no bias). invariant: as `rms_norm`'s."""
    xf = x.astype(jnp.float32)
    xc = xf - _mean(xf, invariant)
    y = xc * jax.lax.rsqrt(_mean(xc * xc, invariant) + eps) * w.astype(jnp.float32)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


def norm(x: jax.Array, p: dict, name: str, cfg: ModelConfig, mb: str = "xla") -> jax.Array:
    """The model's norm `name` of parameter dict p (a layer's, or the whole pytree for final_norm) applied to x
    [..., hidden]: `rms_norm` with p[name], or with cfg.norm_kind "layernorm" `layer_norm` with p[name] and its bias
    p[name + "_bias"] when present. mb: the matmul backend; a batch-invariant one (`quant.ROW_INVARIANT`) sums the
    norm in a fixed order too."""
    invariant = mb in ROW_INVARIANT
    if cfg.norm_kind == "layernorm":
        return layer_norm(x, p[name], p.get(f"{name}_bias"), cfg.rms_norm_eps, invariant)
    return rms_norm(x, p[name], cfg.rms_norm_eps, invariant)


def activation(x: jax.Array, name: str) -> jax.Array:
    """The MLP's activation `name` (`netra_jax.config.ACTIVATIONS`): silu, gelu (exact) or gelu_tanh."""
    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=name == "gelu_tanh")
