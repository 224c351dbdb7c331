"""The KV write: a step's new keys and values scattered into their slots of the paged cache, in place in the
donated pages (quantized on the way into an int8 / fp8 cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops.kv_quant import Pages, QuantizedPages, quantize


def _scatter(pages: jax.Array, x: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """pages [num_pages, page_size, ...] with x [T, ...] set at the flat slots (out-of-range slots dropped)."""
    n, p = pages.shape[:2]
    flat = pages.reshape(n * p, *pages.shape[2:]).at[slot_mapping].set(x.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def _write(pages: Pages, x: jax.Array, slot_mapping: jax.Array) -> Pages:
    """One cache's write: x [T, kv_heads, head_dim] as is, or quantized with its scales [T, kv_heads]."""
    if not isinstance(pages, QuantizedPages):
        return _scatter(pages, x, slot_mapping)
    values, scales = quantize(x, pages.dtype)
    return QuantizedPages(_scatter(pages.values, values, slot_mapping), _scatter(pages.scales, scales, slot_mapping))


def write_kv(k_pages: Pages, v_pages: Pages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Scatter new keys/values into their slots, in place in the (donated) pages. Padding tokens carry an
    out-of-range slot and are dropped. Into a `QuantizedPages` cache each token's key (value) of each KV head is
    quantized with its own scale (`kv_quant.quantize`), and the scale is written at the same slot.

    A lone token's write gets a second, dropped entry: XLA turns a one-index scatter into a dynamic-update-slice
    that reads the old value at the slot, and then copies the whole page array rather than update it in place
    (on CPU a decode step of a 1 GiB cache copied every layer's pages: 0.9 s a token instead of 0.04).

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]; slot_mapping: [T].
    """
    n, p = k_pages.shape[:2]
    if slot_mapping.shape[0] == 1:  # a lone token: add a dropped one (see the docstring)
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), n * p, slot_mapping.dtype)])
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    return _write(k_pages, k, slot_mapping), _write(v_pages, v, slot_mapping)
