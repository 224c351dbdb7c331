"""FP8 W8A8 matmul through XLA's native fp8 dot, vLLM's dynamic per-token scheme: x's rows quantized to e4m3 with a
scale each, the dot in fp8 with a float32 accumulator, the row and the weight's per-channel scales applied after.
On sm89+ XLA's GEMM rewriter turns the dot into cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`, checked by the GPU
compile check); GPUs without fp8 tensor cores (sm80) take the weight-only W8A16 product instead (`has_fp8`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def has_fp8(compute_capability: str | None) -> bool:
    """Whether a GPU of `compute_capability` ("9.0") multiplies in fp8: 8.9 (Ada) and above; None: no."""
    if not compute_capability:
        return False
    major, minor = (int(v) for v in str(compute_capability).split(".")[:2])
    return (major, minor) >= (8, 9)


def quantize_rows_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= q * scale: each row's absolute maximum
    maps to 448 and the cast rounds to nearest even (a zero row gets scale 1)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)  # [M, 1]
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(xf / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)  # [M, K]
    return q, scale


def fp8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """x [M, K] @ (q [K, N] float8_e4m3fn * scale [N] float32) as W8A8: x quantized per row (`quantize_rows_e4m3`),
    one fp8 dot accumulated in float32, then both scales; -> [M, N] in out_dtype (x's dtype when None)."""
    if q.dtype != jnp.float8_e4m3fn or q.ndim != 2 or x.ndim != 2 or x.shape[1] != q.shape[0]:
        raise ValueError(f"fp8 matmul: x {x.shape} @ q {q.shape} {q.dtype} needs [M, K] @ [K, N] float8_e4m3fn")
    qx, sx = quantize_rows_e4m3(x)
    y = lax.dot_general(qx, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)  # [M, N]
    return (y * sx * scale.reshape(1, -1)).astype(out_dtype or x.dtype)


def fp8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """The W8A8 product's rounding in float32 at full precision: x's rows through e4m3 and back, times the
    de-quantized weight (what `fp8_matmul` computes, up to the order of the accumulation)."""
    qx, sx = quantize_rows_e4m3(x)
    xr = qx.astype(jnp.float32) * sx  # [M, K] x as the fp8 dot sees it
    w = q.astype(jnp.float32) * scale.reshape(1, -1)  # [K, N]
    return jnp.dot(xr, w, precision=lax.Precision.HIGHEST).astype(out_dtype)


__all__ = ["E4M3_MAX", "fp8_matmul", "fp8_matmul_reference", "has_fp8", "quantize_rows_e4m3"]
