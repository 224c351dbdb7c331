"""Per-token paged attention on CPU: the kernel in `cpu_attention.cc` (built by `netra_jax.ops.cpu_kernels`), called
through XLA's FFI for the reference backend's per-token rows (decodes, speculative runs); the "cpu" backend of
`netra_jax.ops.attention` runs it, and the jnp per-token path is its reference.

Each listed token attends, per KV head, to its keys through its block-table row with an exact softmax in float32
(the jnp path's online softmax over chunks gives the same result up to rounding). Float32 queries, with float32
pages or quantized ones (`QuantizedPages` of int8, fp8 e4m3 or e5m2, de-quantized in the kernel's loops): other
dtypes run the jnp path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops.kv_quant import Pages, QuantizedPages, page_operands

__all__ = ["KV_FORMATS", "TARGET", "reads_pages", "takes", "token_attention"]

TARGET = "netra_token_attention_f32"


# the kernel's `kv_format` attribute per page dtype (see cpu_attention.cc)
KV_FORMATS = {
    np.dtype(jnp.float32): 0,
    np.dtype(jnp.int8): 1,
    np.dtype(jnp.float8_e4m3fn): 2,
    np.dtype(jnp.float8_e5m2): 3,
    np.dtype(jnp.bfloat16): 4,  # read as they are by the batch-invariant backend (`takes` keeps them on jnp)
}


def takes(q: jax.Array, k_pages: Pages) -> bool:
    """Whether `token_attention` takes these operands: float32 queries; float32 pages, or quantized pages."""
    if q.dtype != jnp.float32:
        return False
    return isinstance(k_pages, QuantizedPages) or k_pages.dtype == jnp.float32


def reads_pages(k_pages: Pages) -> bool:
    """Whether the kernel reads pages of this kind: float32 or bfloat16 arrays, or quantized pages."""
    return isinstance(k_pages, QuantizedPages) or np.dtype(k_pages.dtype) in KV_FORMATS


def token_attention(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    tokens: jax.Array,
    count: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    rows: jax.Array,
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    target: str = TARGET,
) -> jax.Array:
    """Attention of the tokens tokens[:count] (entries >= T are skipped), zeros for every other row.

    q: [T, H, D] float32; k_pages, v_pages: [num_pages, page_size, KH, D] float32 or bfloat16, or `QuantizedPages`
    (already holding this step's keys);
    tokens: [N] int32; count: [] int32; positions, valid: [T] each token's absolute position and whether it is real;
    rows: [T, max_pages] int32 each token's block-table row; sinks: [H] float32 attention-sink logits or None.
    target: the FFI target to call (another registered build of the kernel). Returns [T, H, D] float32."""
    T, H, _ = q.shape
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return call(
        q,
        *page_operands(k_pages, v_pages),
        tokens.astype(jnp.int32),
        jnp.reshape(count, (1,)).astype(jnp.int32),
        positions.astype(jnp.int32),
        valid,
        rows.astype(jnp.int32),
        jnp.zeros((H,), jnp.float32) if sinks is None else sinks.reshape(H).astype(jnp.float32),
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
        window=int(sliding_window or 0),
        has_sinks=sinks is not None,
        kv_format=KV_FORMATS[np.dtype(k_pages.dtype)],
    )
