"""Quantized KV-cache storage: int8 or fp8 (e4m3, e5m2) pages with one float32 scale per (slot, KV head) in a
parallel paged array, quantized when a key or value is written and de-quantized where an attention backend reads it.

Each key or value vector x [head_dim] of one token and KV head is stored as round(x / s) in the cache's type with
s = amax(|x|) / qmax (symmetric; qmax 127 for int8, 448 for fp8 e4m3, 57344 for fp8 e5m2), and read back as the
stored value times s. The scales share the pages' first three axes, so they follow the same block table, slot
mapping, donation and head sharding as the values."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# vLLM's --kv-cache-dtype names (plus the float types) -> the cache's storage dtype; "auto" = the parameters' dtype
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}

QUANTIZED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")  # the names that keep scales

# the largest magnitude each quantized storage type holds: a vector's amax maps onto it
QMAX = {
    np.dtype(jnp.int8): 127.0,
    np.dtype(jnp.float8_e4m3fn): 448.0,
    np.dtype(jnp.float8_e5m2): 57344.0,
}


def is_quantized(dtype) -> bool:
    """Whether a KV cache of this storage dtype keeps scales (int8, fp8 e4m3 or e5m2)."""
    return np.dtype(dtype) in QMAX


def storage_dtype(kv_cache_dtype: str, params_dtype) -> np.dtype:
    """The KV cache's storage dtype for a --kv-cache-dtype name ("auto": the parameters' dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return np.dtype(params_dtype if dtype is None else dtype)


def bytes_per_slot_head(dtype, head_dim: int) -> int:
    """Bytes one (slot, KV head) of one K or V cache takes: its head_dim values, plus its float32 scale if quantized."""
    return head_dim * np.dtype(dtype).itemsize + (4 if is_quantized(dtype) else 0)


@flax.struct.dataclass
class QuantizedPages:
    """One layer's K (or V) cache in a quantized type: values [num_pages, page_size, kv_heads, head_dim] (int8 or fp8)
    and their scales [num_pages, page_size, kv_heads] float32. `shape` and `dtype` are the values'."""

    values: jax.Array  # [num_pages, page_size, kv_heads, head_dim] int8 / float8
    scales: jax.Array  # [num_pages, page_size, kv_heads] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim


Pages = jax.Array | QuantizedPages  # one layer's K or V cache, float or quantized


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantize vectors along the last axis: x [..., D] float -> (values [..., D] in dtype, scales [...] float32).
    An all-zero vector gets scale 0 and zero values."""
    xf = x.astype(jnp.float32)
    qmax = QMAX[np.dtype(dtype)]
    scales = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [...]
    y = xf / jnp.where(scales > 0, scales, 1.0)[..., None]  # [..., D] within [-qmax, qmax]
    if np.dtype(dtype) == np.dtype(jnp.int8):
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    return y.astype(dtype), scales


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., D] int8 / float8 and scales [...] float32 -> float32 [..., D]."""
    return values.astype(jnp.float32) * scales[..., None]


def empty_pages(shape: tuple[int, ...], dtype, sharding=None) -> Pages:
    """A zeroed layer cache of `shape` [num_pages, page_size, kv_heads, head_dim]: a plain array for a float dtype, a
    `QuantizedPages` for int8 / fp8. sharding: the values' (the scales take its first three axes)."""
    if not is_quantized(dtype):
        return jnp.zeros(shape, dtype, device=sharding)
    return QuantizedPages(
        values=jnp.zeros(shape, dtype, device=sharding),
        scales=jnp.zeros(shape[:3], jnp.float32, device=scales_sharding(sharding)),
    )


def scales_sharding(sharding):
    """The scales' sharding for the values' `sharding`: the same devices, a NamedSharding without its last axis."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:3]))
    return sharding


def take_pages(pages: Pages, ids: jax.Array) -> jax.Array:
    """The pages `ids` [...] (clipped into range) as float32 [..., page_size, kv_heads, head_dim], de-quantized.

    Gathers each page as one row of a 2-D array (one contiguous copy per page: faster than a 4-D gather on CPU)."""
    n, p, kh, d = pages.shape
    if not isinstance(pages, QuantizedPages):
        rows = jnp.take(pages.reshape(n, -1), ids, axis=0, mode="clip")  # [..., p * kh * d]
        return rows.reshape(*ids.shape, p, kh, d).astype(jnp.float32)
    values = jnp.take(pages.values.reshape(n, -1), ids, axis=0, mode="clip").reshape(*ids.shape, p, kh, d)
    scales = jnp.take(pages.scales.reshape(n, -1), ids, axis=0, mode="clip").reshape(*ids.shape, p, kh)
    return dequantize(values, scales)


def page_operands(k_pages: Pages, v_pages: Pages) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A kernel's four page operands: (K values, V values, K scales, V scales); float pages get [1, 1, 1] zero
    scales, which a kernel compiled for float pages never reads."""
    if isinstance(k_pages, QuantizedPages):
        return k_pages.values, v_pages.values, k_pages.scales, v_pages.scales
    none = jnp.zeros((1, 1, 1), jnp.float32)
    return k_pages, v_pages, none, none


def dequantize_pages(pages: Pages) -> jax.Array:
    """A whole layer cache as float32 [num_pages, page_size, kv_heads, head_dim] (for tests and research reads)."""
    if isinstance(pages, QuantizedPages):
        return dequantize(pages.values, pages.scales)
    return pages.astype(jnp.float32)


__all__ = [
    "KV_CACHE_DTYPES",
    "QMAX",
    "QUANTIZED_KV_CACHE_DTYPES",
    "Pages",
    "QuantizedPages",
    "bytes_per_slot_head",
    "dequantize",
    "dequantize_pages",
    "empty_pages",
    "is_quantized",
    "page_operands",
    "quantize",
    "scales_sharding",
    "storage_dtype",
]
