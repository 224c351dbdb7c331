"""Few-row float32 matmul on CPU: the kernel in `cpu_matmul.cc` (built by `netra_jax.ops.cpu_kernels`), called
through XLA's FFI, for the decode-sized matmuls XLA's CPU dot runs slowly; `jnp.dot` is its reference.

A decode step multiplies one row per running sequence by every weight matrix. On CPU that is a stream of the weights
through the cores, and XLA's dot streams them at about half speed from 8 rows on (11.5 against 20.1 GB/s for
SmolLM2's [576, 1536] at 8 rows on a 2-core Xeon; see the .cc file for the kernel's layout). The kernel takes
x [M, K] @ w [K, N] in float32 for ROWS_MIN <= M <= ROWS_MAX; other shapes and dtypes run `jnp.dot`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_kernels

__all__ = ["ROWS_MAX", "ROWS_MIN", "TARGET", "rows_matmul", "takes"]

TARGET = "netra_small_matmul_f32"
# One row: XLA's dot streams the weights faster (27 against 22 GB/s). Past 32 rows the kernel's row tiles make it
# compute-bound and XLA's blocked dot catches up.
ROWS_MIN = 2
ROWS_MAX = 32


def takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether `rows_matmul` runs the kernel for these operands (else `jnp.dot`)."""
    return (
        x.ndim == 2
        and w.ndim == 2
        and ROWS_MIN <= x.shape[0] <= ROWS_MAX
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
    )


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@jax.custom_jvp
def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _kernel(x, w)


@_rows_matmul.defjvp
def _rows_matmul_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _kernel(x, w), jnp.dot(dx, w) + jnp.dot(x, dw)  # linear in the tangents: reverse mode transposes it


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] on the CPU kernel when it `takes` them and is `available`, else `jnp.dot`. Differentiable
    (forward and reverse: the derivative is jnp's). Lowers for CPU only."""
    if takes(x, w) and cpu_kernels.available():
        return _rows_matmul(x, w)
    return jnp.dot(x, w)
