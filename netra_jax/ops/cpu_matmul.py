"""Few-row matmuls on CPU: the kernels in `cpu_matmul.cc` (built by `netra_jax.ops.cpu_kernels`), called through
XLA's FFI, for the decode-sized matmuls XLA's CPU dot runs slowly; `jnp.dot` is their reference.

A decode step multiplies one row per running sequence by every weight matrix. On CPU that is a stream of the weights
through the cores, and XLA's dot streams them at about half speed from 8 rows on (11.5 against 20.1 GB/s for
SmolLM2's [576, 1536] at 8 rows on a 2-core Xeon; see the .cc file for the kernel's layout). The kernel takes
x [M, K] @ w [K, N] in float32 for ROWS_MIN <= M <= ROWS_MAX; other shapes and dtypes run `jnp.dot`. `invariant_matmul`
runs it for any M (float32 or bfloat16 weights, widened in registers), the batch-invariant matmul.

int8 and float8 e4m3fn weights (for `netra_jax.quant`'s weight-only int8 and fp8 matmuls): x float32 [M, K] @ w
[K, N] as float32, the weights widened to float in registers, for 1 <= M <= ROWS_MAX (one row too: XLA converts the
whole weight to float in memory before its dot, which reads and writes 9 bytes per weight where the kernel reads 1).
An e4m3 weight's NaN pattern reads as 480 in the kernel (quantized weights hold none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_kernels

__all__ = ["ROWS_MAX", "ROWS_MIN", "TARGETS", "invariant_matmul", "rows_matmul", "takes"]

TARGETS = {  # by w's dtype
    jnp.dtype(jnp.float32): "netra_small_matmul_f32",
    jnp.dtype(jnp.int8): "netra_small_matmul_i8",
    jnp.dtype(jnp.float8_e4m3fn): "netra_small_matmul_e4m3",
    jnp.dtype(jnp.bfloat16): "netra_small_matmul_bf16",  # read by `invariant_matmul` (float32 x)
}
_FLOAT_WEIGHTS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # weights with a tangent (quantized ones have none)
# One row too: the kernel's row stream reads float32 weights faster than XLA's dot (SmolLM2's lm_head 30.0 against
# 28.9 GB/s, its [576, 3072] MLP weight 18.6 against 15.2 on a 2-core AVX-512 Xeon), and every row count then sums
# in the same order (batch-invariant). Past 32 rows the kernel's row tiles make it compute-bound and XLA's blocked
# dot catches up.
ROWS_MIN = 1
ROWS_MAX = 32


def takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether `rows_matmul` runs a kernel for these operands (else `jnp.dot`): float32 x of ROWS_MIN..ROWS_MAX rows
    times float32, int8 or e4m3 w."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype not in TARGETS:
        return False
    return ROWS_MIN <= x.shape[0] <= ROWS_MAX


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[w.dtype], out, vmap_method="sequential")(x, w)


@jax.custom_jvp
def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _kernel(x, w)


@_rows_matmul.defjvp
def _rows_matmul_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    dy = jnp.dot(dx, w.astype(jnp.float32))
    if w.dtype in _FLOAT_WEIGHTS:  # a quantized weight has no tangent
        dy = dy + jnp.dot(x, dw.astype(jnp.float32))
    return _kernel(x, w), dy  # linear in the tangents: reverse mode transposes it


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] (w float32, int8 or e4m3, a quantized weight's scales left to the caller) on a CPU kernel
    when it `takes` them and is `available`, else `jnp.dot` (of the widened weight). Differentiable (forward and
    reverse, in w too when it is float: the derivative is jnp's). Lowers for CPU only."""
    if takes(x, w) and cpu_kernels.available():
        return _rows_matmul(x, w)
    return jnp.dot(x, w.astype(x.dtype))


def invariant_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] float32 @ w [K, N] (float32, bfloat16, int8 or e4m3) -> [M, N] float32 on the kernel for any number
    of rows M: every output summed over k in order, one fused multiply-add at a time, so a row's result is the same
    whatever rows share the call (batch-invariant; from 32 rows on slower than XLA's blocked dot, which sums in an
    order that depends on M). Differentiable as `rows_matmul` (in w too when it is float32 or bfloat16). ValueError
    for operands it does not take, or when the kernels are not available. Lowers for CPU only."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype not in TARGETS:
        raise ValueError(
            f"invariant_matmul takes float32 x [M, K] and a float32, bfloat16, int8 or e4m3 w [K, N]; got {x.dtype}"
            f"{list(x.shape)} @ {w.dtype}{list(w.shape)}"
        )
    if not cpu_kernels.available():
        raise ValueError(f"invariant_matmul needs the CPU kernels: {cpu_kernels.unavailable_reason()}")
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[1]), jnp.float32)
    return _rows_matmul(x, w)
