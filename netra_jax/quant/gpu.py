"""The "gpu" matmul backend: PackedIntWeight products on the Pallas W4A16 / W8A16 kernel (`ops.packed_matmul_triton`)
and fp8 weights as W8A8 on XLA's fp8 dot where the GPU multiplies in fp8 (`ops.fp8_matmul`; elsewhere the reference's
W8A16). Returns None for a product they do not take (the entry point then runs the reference). "gpu_interpret" runs
the same kernel in the Pallas interpreter (CPU tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import fp8_matmul as fp8
from netra_jax.ops.packed_matmul_triton import packed_matmul_triton
from netra_jax.quant.reference import rows_form
from netra_jax.quant.weights import PackedIntWeight, QuantizedWeight


def packed_matmul(x: jax.Array, w, spec: str | None, preferred_element_type, interpret: bool = False):
    """x @ w on the packed kernel for a PackedIntWeight in the plain form ([M, K] @ [K, *out]), else None."""
    if not (isinstance(w, PackedIntWeight) and rows_form(spec, x, w)):
        return None
    y = packed_matmul_triton(
        x,
        w.packed,
        w.scale,
        w.zero,
        w.g_idx,
        bits=w.bits,
        group=w.group,
        out_dtype=preferred_element_type or x.dtype,
        interpret=interpret,
    )  # [M, N]
    return y.reshape(x.shape[0], *w.shape[1:])


def packed_matmul_interpret(x: jax.Array, w, spec: str | None, preferred_element_type):
    return packed_matmul(x, w, spec, preferred_element_type, interpret=True)


def fp8_w8a8_matmul(x: jax.Array, w, spec: str | None, preferred_element_type):
    """x @ w as W8A8 for an fp8 QuantizedWeight in the plain form on a GPU with fp8 tensor cores, else None."""
    if not (isinstance(w, QuantizedWeight) and w.q.dtype == jnp.float8_e4m3fn and rows_form(spec, x, w)):
        return None
    if not fp8.native_fp8():
        return None
    q = w.q.reshape(w.shape[0], -1)  # [K, N]
    y = fp8.fp8_matmul(x, q, w.scale.reshape(-1), out_dtype=preferred_element_type or x.dtype)
    return y.reshape(x.shape[0], *w.shape[1:])
