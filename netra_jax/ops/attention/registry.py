"""The attention backends by name (`BACKENDS`) and the one "auto" runs for a device and the step's shapes."""

from __future__ import annotations

import jax

from netra_jax.ops.attention.cpu import cpu_backend, paged_attention_cpu, paged_attention_cpu_invariant
from netra_jax.ops.attention.reference import paged_attention_reference
from netra_jax.ops.kv_quant import QUANTIZED_KV_CACHE_DTYPES
from netra_jax.ops.paged_attention_mosaic import (
    paged_attention_mosaic,
    paged_attention_mosaic_interpret,
    supports,
)
from netra_jax.ops.paged_attention_triton import paged_attention_triton, paged_attention_triton_interpret


def auto_backend(
    platform: str, compute_capability: str | None, *, dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size
) -> str:
    """The backend "auto" runs: the Mosaic GPU kernel on Hopper (sm90: its wgmma exists there only, not on
    Blackwell) for the dtypes and shapes it takes (bf16/fp16 queries and cache, head_dim a multiple of 64, see
    `paged_attention_mosaic.supports`), the Triton kernel on other GPUs and shapes; on CPU the "cpu" backend (the
    reference with its per-token rows on the C++ kernel) when the kernels build, else the jnp reference.
    compute_capability: the device's, e.g. "9.0"."""
    if platform == "cpu":
        return cpu_backend()
    if platform != "gpu":
        return "reference"
    hopper = compute_capability is not None and compute_capability.split(".")[0] == "9"
    if hopper and supports(dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size) is None:
        return "mosaic"
    return "triton"


def _auto(q, k_pages, v_pages, md, **kw):
    """The backend `auto_backend` picks for this device and these (static) shapes."""
    dev = jax.devices()[0]
    name = auto_backend(
        jax.default_backend(),
        getattr(dev, "compute_capability", None),
        dtype=q.dtype,
        kv_dtype=k_pages.dtype,
        q_heads=q.shape[1],
        kv_heads=k_pages.shape[2],
        head_dim=q.shape[2],
        page_size=k_pages.shape[1],
    )
    return BACKENDS[name](q, k_pages, v_pages, md, **kw)


# backends that cannot read an int8 / fp8 KV cache (Mosaic GPU's wgmma pipeline takes bf16 / fp16 pages only)
_FLOAT_KV_ONLY = ("mosaic", "mosaic_interpret")


def backend_refuses_kv(backend: str, kv_cache_dtype: str) -> str | None:
    """Why `backend` cannot run over a KV cache of `kv_cache_dtype` (a --kv-cache-dtype name), or None if it can.
    "auto" never refuses: it picks a backend that reads the cache."""
    if backend in _FLOAT_KV_ONLY and kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
        return (
            f"attention_backend {backend!r} cannot read a {kv_cache_dtype} KV cache (it reads float pages only); "
            "use 'auto', 'triton' or 'reference', or a float kv_cache_dtype"
        )
    return None


BACKENDS = {
    "reference": paged_attention_reference,
    "cpu": paged_attention_cpu,
    "cpu_invariant": paged_attention_cpu_invariant,
    "triton": paged_attention_triton,
    "triton_interpret": paged_attention_triton_interpret,
    "mosaic": paged_attention_mosaic,
    "mosaic_interpret": paged_attention_mosaic_interpret,
    "auto": _auto,
}
