"""Few-row matmuls against weights kept in llama.cpp's GGML block formats, on CPU: the kernel in
`cpu_ggml_matmul.cc` (built by `netra_jax.ops.cpu_kernels`), called through XLA's FFI.

`blocks_matmul(x, w, qtype)` is x [M, K] float32 @ W^T -> [M, N] float32, where W [N, K] is given as the raw bytes
of a GGUF tensor of that type: w uint8 [N, row_bytes], each row K / QK consecutive blocks (row_bytes = K / QK *
BLOCK_BYTES), so that `gguf.quants.dequantize(w, qtype)` is W. The kernel reads the blocks as they are and
de-quantizes them in registers and L1 as it goes: a decode step reads 4.5-8.5 bits per weight instead of float32's 32
(see the .cc file for the layout).

Rows: 1 to ROWS_MAX. A decode step's rows (one per running sequence) are few, and the kernel's cost is the weights'
bytes (one row) or their FMAs with the de-quantization spread over the rows. Past about 128 rows the product is
compute-bound and XLA's cache-blocked dot wins even counting its de-quantization of the whole weight: K 2048, N 8192
Q4_0 on a 2-core Xeon, kernel / XLA dot of the float weight / XLA de-quantize and dot: 64 rows 8.3 / 9.8 / 26.5 ms,
128 rows 16.7 / 16.9 / 33.4 ms, 256 rows 45.9 / 30.7 / 47.8 ms. Prefills take XLA's path.

Derivative: in x only (the weight's bytes have none). The tangent is XLA's dot with the weight de-quantized by
`netra_jax.ops.ggml_blocks` (linear in x, so reverse mode transposes it; an FFI call has no transpose)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops import cpu_kernels
from netra_jax.ops.ggml_blocks import FORMATS, dequantize_rows

__all__ = ["ROWS_MAX", "TARGET", "TYPES", "blocks_matmul", "takes"]

TARGET = "netra_ggml_matmul_f32"
TYPES = tuple(FORMATS)  # the kernel reads every kept format (`ggml_blocks.FORMATS`: values, bytes, type number)
ROWS_MAX = 128


def _why_not(x, w, qtype) -> str | None:
    """Why `blocks_matmul` does not take these operands, or None when it does (the kernels' build aside)."""
    if qtype not in TYPES:
        return f"GGML type {qtype!r} is not one of {', '.join(TYPES)}"
    qk, block_bytes = FORMATS[qtype].qk, FORMATS[qtype].block_bytes
    if getattr(x, "ndim", None) != 2 or x.dtype != jnp.float32:
        return f"x must be float32 [M, K], got {getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}"
    if not 1 <= x.shape[0] <= ROWS_MAX:
        return f"x has {x.shape[0]} rows, the kernel takes 1 to {ROWS_MAX}"
    if getattr(w, "ndim", None) != 2 or w.dtype != jnp.uint8:
        return f"w must be uint8 [N, row_bytes], got {getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}"
    if w.shape[1] % block_bytes or w.shape[1] // block_bytes * qk != x.shape[1]:
        return (
            f"{qtype} rows of K = {x.shape[1]} values are {x.shape[1] / qk * block_bytes:g} bytes "
            f"({qk} values in {block_bytes} bytes per block), w's are {w.shape[1]}"
        )
    return None


def takes(x: jax.Array, w: jax.Array, qtype: str) -> bool:
    """Whether `blocks_matmul` runs for these operands: float32 x [M, K] of 1..ROWS_MAX rows, uint8 w [N, row_bytes]
    holding K values per row in `qtype` blocks, and the kernels built."""
    return _why_not(x, w, qtype) is None and cpu_kernels.available()


def _kernel(x: jax.Array, w: jax.Array, qtype: str) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x, w, qtype=np.int32(FORMATS[qtype].ggml_type))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _blocks_matmul(x: jax.Array, w: jax.Array, qtype: str) -> jax.Array:
    return _kernel(x, w, qtype)


@_blocks_matmul.defjvp
def _blocks_matmul_jvp(qtype, primals, tangents):
    (x, w), (dx, _) = primals, tangents
    return _kernel(x, w, qtype), jnp.dot(dx, dequantize_rows(w, qtype).T)


def blocks_matmul(x: jax.Array, w: jax.Array, qtype: str) -> jax.Array:
    """x [M, K] float32 @ W^T -> [M, N] float32, W [N, K] the GGML `qtype` blocks in w uint8 [N, row_bytes] (the
    bytes of a GGUF tensor of ne [K, N]). `qtype` is the type's name ("Q4_0", ..., static). Raises ValueError for
    operands it does not take (see `takes`; the caller checks it first) and RuntimeError when the kernels could not be
    built. Differentiable in x (forward and reverse). Lowers for CPU only."""
    why = _why_not(x, w, qtype)
    if why is not None:
        raise ValueError(f"blocks_matmul: {why}")
    if not cpu_kernels.available():
        raise RuntimeError(f"blocks_matmul: the C++ CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    return _blocks_matmul(x, w, qtype)
