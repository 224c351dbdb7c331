"""Reductions in a fixed order for the batch-invariant numerics: a pairwise tree over the last axis written as
elementwise adds, whose rounding XLA must keep, so a row's sum never depends on the rows beside it or the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["tree_logsumexp", "tree_mean", "tree_softmax", "tree_sum"]

# Why: XLA's reduce leaves the order of a sum to the compiler, and on CPU it changes with the number of rows (an
# RMSNorm of one row and the same row among 300 differed in the last bit), so the engine's decode step and a
# training forward over the whole sequence disagree. Halving the axis with adds of slices fixes the order: element
# i of the first half plus element i of the second, log2(n) times, zeros padding n up to a power of two.


def tree_sum(x: jax.Array) -> jax.Array:
    """x [..., n] -> [...]: the sum over the last axis in a fixed pairwise order (the same bits for a row whatever
    the leading shape; differentiable)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def tree_mean(x: jax.Array) -> jax.Array:
    """The mean over the last axis, summed by `tree_sum`. [..., n] -> [...]."""
    return tree_sum(x) / jnp.asarray(x.shape[-1], x.dtype)


def tree_logsumexp(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis (the max subtracted first; the max itself is exact in any order).
    [..., n] -> [...]; rows of -inf give -inf."""
    m = jnp.max(x, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m_safe + jnp.log(tree_sum(jnp.exp(x - m_safe[..., None])))


def tree_softmax(x: jax.Array) -> jax.Array:
    """softmax over the last axis with a `tree_sum` denominator. [..., n] -> [..., n]."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / tree_sum(e)[..., None]
