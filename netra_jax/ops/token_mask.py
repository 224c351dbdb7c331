"""Allowed-token masks for the sampler: per-row packed bitmasks (int32 words, bit j of word i = token 32 i + j, as
llguidance writes them), stacked on the host and expanded to [S, V] on the device only in the mask variant."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def stack_masks(masks: Sequence[np.ndarray | None], num_rows: int, vocab_size: int) -> np.ndarray | None:
    """[S, W] int32 with each row's mask; rows without one (and padding rows) allow every token. Words beyond a short
    mask disallow their tokens, words beyond W are dropped. None when no row has a mask (the variant is not used)."""
    if all(m is None for m in masks):
        return None
    w = num_words(vocab_size)
    out = np.full((num_rows, w), -1, np.int32)
    for i, m in enumerate(masks):
        if m is not None:
            m = np.asarray(m, np.int32).reshape(-1)[:w]
            out[i, : m.size] = m
            out[i, m.size :] = 0
    return out


def apply_mask(x: jax.Array, words: jax.Array) -> jax.Array:
    """x [S, V] with the tokens whose bit is clear in words [S, W] set to -inf (one elementwise pass)."""
    s, v = x.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    return jnp.where(bits.reshape(s, -1)[:, :v] != 0, x, -jnp.inf)
