"""The "cpu_rows", "cpu_rows_q8" and "cpu_invariant" matmul backends: decode-sized float32 products on the CPU FFI
kernels ("cpu_invariant": every product, batch-invariant, see `cpu_invariant_matmul`), float32,
int8 and fp8 (e4m3, per output channel) weights on `ops.cpu_matmul`'s few-row kernels and GGML blocks on
`ops.cpu_ggml_matmul`'s ("cpu_rows_q8": the activations of `cpu_ggml_matmul.INT8_TYPES` products rounded to int8
blocks of 32 first, llama.cpp's arithmetic, for any number of rows). Return None for a product they do not take (the
entry point then runs the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_ggml_matmul, cpu_matmul
from netra_jax.quant.reference import rows_form
from netra_jax.quant.weights import GGMLWeight, QuantizedWeight, is_quantized


def cpu_rows_matmul(x: jax.Array, w, spec: str | None, preferred_element_type) -> jax.Array | None:
    """x @ w on the CPU kernels when the product has their plain form ([M, K] @ [K, *out]) and they take it
    (float32 x of few rows; preferred_element_type changes nothing for them), else None."""
    return _cpu_rows(x, w, spec, int8_x=False)


def cpu_rows_q8_matmul(x: jax.Array, w, spec: str | None, preferred_element_type) -> jax.Array | None:
    """As `cpu_rows_matmul`, with the activations of GGML weights of `cpu_ggml_matmul.INT8_TYPES` rounded to int8
    blocks in the kernel (integer dot products, for any number of rows: prefill steps included)."""
    return _cpu_rows(x, w, spec, int8_x=True)


def cpu_invariant_matmul(x: jax.Array, w, spec: str | None, preferred_element_type) -> jax.Array:
    """The "cpu_invariant" backend (batch-invariant): x @ w on `ops.cpu_matmul.invariant_matmul` for any number of
    rows, float32 or bfloat16 x (widened to float32) times float32 or bfloat16 weights, or int8 / e4m3 ones with
    per-channel scales; every output summed over the input axis in order, so a row's result never depends on the other
    rows. The result in preferred_element_type, else x's dtype. ValueError for a product it does not take (other
    quantized formats, other einsum forms): the reference would not be batch-invariant."""
    if isinstance(w, QuantizedWeight) and w.batch_dims == 0 and rows_form(spec, x, w):
        y = _invariant_rows(x, w.q) * w.scale  # [M, *out] float32
    elif not is_quantized(w) and w.dtype in (jnp.float32, jnp.bfloat16) and rows_form(spec, x, w):
        y = _invariant_rows(x, w)
    else:
        raise ValueError(
            "matmul_backend 'cpu_invariant' multiplies float32 / bfloat16 weights and per-channel int8 / fp8 ones in "
            f"the form [M, K] @ [K, *out]; got {type(w).__name__} {getattr(w, 'dtype', '')} (spec {spec!r})"
        )
    return y.astype(preferred_element_type or x.dtype)


def _invariant_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    w2 = w.reshape(w.shape[0], -1)  # [K, prod(out)]
    y = cpu_matmul.invariant_matmul(x.astype(jnp.float32), w2)  # [M, prod(out)] float32
    return y.reshape(x.shape[0], *w.shape[1:])


def ggml_int8_x(qtype: str, int8_x: bool) -> bool:
    """Whether a `qtype` product reads int8 activations when the backend asks for them (`int8_x`)."""
    return int8_x and qtype in cpu_ggml_matmul.INT8_TYPES


def _cpu_rows(x: jax.Array, w, spec: str | None, int8_x: bool) -> jax.Array | None:
    if not rows_form(spec, x, w):
        return None
    if isinstance(w, GGMLWeight):
        rows = w.data.reshape(-1, w.data.shape[-1])  # [N, row_bytes]: the output axes flattened
        q8 = ggml_int8_x(w.qtype, int8_x)
        if not (w.transposed and w.batch_dims == 0 and cpu_ggml_matmul.takes(x, rows, w.qtype, q8)):
            return None
        y = cpu_ggml_matmul.blocks_matmul(x, rows, w.qtype, q8)  # [M, N] float32
        return y.reshape(x.shape[0], *w.shape[1:])
    if isinstance(w, QuantizedWeight) and w.batch_dims == 0:
        y = _few_rows(x, w.q)
        return None if y is None else y * w.scale  # the int8 or e4m3 weights read as they are
    if is_quantized(w):  # no CPU kernel for its format
        return None
    return _few_rows(x, w.astype(x.dtype))


def _few_rows(x: jax.Array, w: jax.Array) -> jax.Array | None:
    w2 = w.reshape(w.shape[0], -1)  # [K, prod(out)]
    if not cpu_matmul.takes(x, w2):
        return None
    return cpu_matmul.rows_matmul(x, w2).reshape(x.shape[0], *w.shape[1:])
