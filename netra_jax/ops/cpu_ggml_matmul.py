"""Few-row matmuls against weights kept in llama.cpp's GGML block formats, on CPU: the kernel in
`cpu_ggml_matmul.cc` (built by `netra_jax.ops.cpu_kernels`), called through XLA's FFI.

`blocks_matmul(x, w, qtype)` is x [M, K] float32 @ W^T -> [M, N] float32, where W [N, K] is given as the raw bytes
of a GGUF tensor of that type: w uint8 [N, row_bytes], each row K / QK consecutive blocks (row_bytes = K / QK *
BLOCK_BYTES), so that `gguf.quants.dequantize(w, qtype)` is W. The kernel reads the blocks as they are and
de-quantizes them in registers and L1 as it goes: a decode step reads 4.5-8.5 bits per weight instead of float32's 32
(see the .cc file for the layout).

Activations: float32 as they are (int8_x=False, the default here), or (int8_x=True, INT8_TYPES) quantized to int8 blocks
of 32 (one scale per 256 values against the K-quants, llama.cpp's Q8_K) in the kernel and multiplied with integer dot
products as llama.cpp does. The engine's CPU default (the "cpu_rows_q8" matmul backend) asks for int8: measured
(benchmarks/ggml_matmul.py, 2-core Xeon, fastest call) it is the faster path for every INT8_TYPES shape, 1-4 rows
1.1-1.6x (Q4_0 K 2048 x N 8192 1 row 0.97 -> 0.82 ms), 12 rows and more 1.5-3.5x (32 rows 12.0 -> 3.5 ms), 128-512 rows
2.5-4x faster than the de-quantize-and-dot reference. The rounding moves a product by up to about 1% of its magnitude
where a block holds an outlier channel: text scores as with llama.cpp (perplexity within 0.1% of float activations), but
greedy answers can differ from the de-quantized weights' (SmolLM2-135M Q4_1's answers to the reference chats match
transformers only with float activations).

Rows: 1 to ROWS_MAX with float activations, any number with int8 ones (split into calls of at most INT8_CHUNK_ROWS
rows). A decode step's rows (one per running sequence) are few, and the kernel's cost is the weights' bytes (one row)
or, with more rows, its arithmetic. With float activations past about 128 rows XLA's cache-blocked dot wins even
counting its de-quantization of the whole weight (K 2048, N 8192 Q4_0 on a 2-core Xeon, kernel / XLA dot of the float
weight / XLA de-quantize and dot: 128 rows 16.7 / 16.9 / 33.4 ms, 256 rows 45.9 / 30.7 / 47.8 ms). The int8 path's
integer dot products (64 multiply-adds an instruction with AVX-512 VNNI, the rows of x in the lanes) beat the
de-quantize-and-dot reference by 2.5-4x at 128 to 512 rows (same shapes, on a busy machine: Q4_0 128 rows 44.7 against
133 ms, 512 rows 128 against 415 ms): with int8 activations prefill steps of any size take the kernel too.

Q4_K_X16 and Q6_K_X16 (`ggml_blocks.interleave_rows`: Q4_K / Q6_K rows in groups of 16, the "cpu_rows_q8" layout on
hosts with AVX-512 VNNI) are read with int8 activations only, by a kernel whose dot products cover 16 rows at once.

Derivative: in x only (the weight's bytes have none). The tangent is XLA's dot with the weight de-quantized by
`netra_jax.ops.ggml_blocks` (linear in x, so reverse mode transposes it; an FFI call has no transpose)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops import cpu_kernels
from netra_jax.ops.ggml_blocks import FORMATS, GGUF_TYPES, dequantize_rows

__all__ = [
    "INT8_CHUNK_ROWS",
    "INT8_TYPES",
    "ROWS_MAX",
    "TARGET",
    "TYPES",
    "blocks_matmul",
    "takes",
]

TARGET = "netra_ggml_matmul_f32"
TYPES = GGUF_TYPES  # with float32 activations: every GGUF type kept (`ggml_blocks.FORMATS`: values, bytes, type number)
ROWS_MAX = 128
# with int8 activations: the GGUF types, and Q4_K_X16 / Q6_K_X16 (their rows interleaved by 16,
# `ggml_blocks.interleave_rows`: int8 activations only, in the builds `cpu_kernels.interleaved_rows()` names)
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_X16", "Q6_K_X16")
# rows per kernel call with int8 activations (the most measured against the reference); more are split into equal calls
INT8_CHUNK_ROWS = 512


def _why_not(x, w, qtype, int8_x: bool) -> str | None:
    """Why `blocks_matmul` does not take these operands, or None when it does (the kernels' build aside)."""
    if qtype not in TYPES and qtype not in INT8_TYPES:
        return f"GGML type {qtype!r} is not one of {', '.join(dict.fromkeys((*TYPES, *INT8_TYPES)))}"
    qk, block_bytes = FORMATS[qtype].qk, FORMATS[qtype].block_bytes
    if getattr(x, "ndim", None) != 2 or x.dtype != jnp.float32:
        return f"x must be float32 [M, K], got {getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}"
    if int8_x and qtype not in INT8_TYPES:
        return f"{qtype} has no int8-activation path (those: {', '.join(INT8_TYPES)})"
    if not int8_x and qtype not in TYPES:
        return f"{qtype} is read with int8 activations only (int8_x=True)"
    if x.shape[0] < 1:
        return "x has 0 rows"
    if not int8_x and x.shape[0] > ROWS_MAX:
        return f"x has {x.shape[0]} rows, the kernel takes 1 to {ROWS_MAX} with float x (any number with int8 x)"
    if getattr(w, "ndim", None) != 2 or w.dtype != jnp.uint8:
        return f"w must be uint8 [N, row_bytes], got {getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}"
    if (rows := FORMATS[qtype].interleaved) and w.shape[0] % rows:
        return f"{qtype} weights hold groups of {rows} rows, w has {w.shape[0]}"
    if w.shape[1] % block_bytes or w.shape[1] // block_bytes * qk != x.shape[1]:
        return (
            f"{qtype} rows of K = {x.shape[1]} values are {x.shape[1] / qk * block_bytes:g} bytes "
            f"({qk} values in {block_bytes} bytes per block), w's are {w.shape[1]}"
        )
    return None


def takes(x: jax.Array, w: jax.Array, qtype: str, int8_x: bool = False) -> bool:
    """Whether `blocks_matmul(x, w, qtype, int8_x)` runs: float32 x [M, K] of 1..ROWS_MAX rows (any number with int8
    activations), uint8 w [N, row_bytes] holding K values per row in `qtype` blocks, and the kernels built."""
    return _why_not(x, w, qtype, bool(int8_x)) is None and cpu_kernels.available()


def _kernel(x: jax.Array, w: jax.Array, qtype: str, int8_x: bool) -> jax.Array:
    m = x.shape[0]
    if int8_x and m > INT8_CHUNK_ROWS:
        calls = -(-m // INT8_CHUNK_ROWS)
        rows = -(-m // calls)  # equal calls: 600 rows are 300 + 300, not 512 + 88
        return jnp.concatenate([_call(x[i : i + rows], w, qtype, int8_x) for i in range(0, m, rows)])
    return _call(x, w, qtype, int8_x)


def _call(x: jax.Array, w: jax.Array, qtype: str, int8_x: bool) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x, w, qtype=np.int32(FORMATS[qtype].ggml_type), int8_x=np.int32(int8_x))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _blocks_matmul(x: jax.Array, w: jax.Array, qtype: str, int8_x: bool) -> jax.Array:
    return _kernel(x, w, qtype, int8_x)


@_blocks_matmul.defjvp
def _blocks_matmul_jvp(qtype, int8_x, primals, tangents):
    (x, w), (dx, _) = primals, tangents
    return _kernel(x, w, qtype, int8_x), jnp.dot(dx, dequantize_rows(w, qtype).T)


def blocks_matmul(x: jax.Array, w: jax.Array, qtype: str, int8_x: bool = False) -> jax.Array:
    """x [M, K] float32 @ W^T -> [M, N] float32, W [N, K] the GGML `qtype` blocks in w uint8 [N, row_bytes] (the
    bytes of a GGUF tensor of ne [K, N]). `qtype` is the type's name ("Q4_0", ..., static). Raises ValueError for
    operands it does not take (see `takes`; the caller checks it first) and RuntimeError when the kernels could not be
    built. Differentiable in x (forward and reverse). Lowers for CPU only.

    int8_x: quantize x's rows to int8 blocks of 32 (per block d = max|x| / 127, taken over 256 values against the
    K-quants; rounded to nearest) and take integer dot products, as llama.cpp does (the result moves by at most sum
    over blocks of d / 2 * sum |w|); False: float products of x as it is. Only INT8_TYPES have the int8 path."""
    int8_x = bool(int8_x)
    why = _why_not(x, w, qtype, int8_x)
    if why is not None:
        raise ValueError(f"blocks_matmul: {why}")
    if not cpu_kernels.available():
        raise RuntimeError(f"blocks_matmul: the C++ CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    return _blocks_matmul(x, w, qtype, int8_x)
