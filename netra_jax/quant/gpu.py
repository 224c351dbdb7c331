"""The GPU matmul backends' kernels: PackedIntWeight products on the Pallas W4A16 / W8A16 kernel
(`ops.packed_matmul_triton`; backends "gpu" and "gpu_sm80", "gpu_interpret" runs it in the Pallas interpreter for CPU
tests) and fp8 weights as W8A8 on XLA's fp8 dot ("gpu", for GPUs with fp8 tensor cores: `ops.fp8_matmul`; "gpu_sm80"
leaves them to the reference's W8A16). Each returns None for a product it does not take (the entry point then runs
the reference)."""

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
    """x @ w as W8A8 for an fp8 QuantizedWeight in the plain form (for GPUs with fp8 tensor cores), else None."""
    if not (isinstance(w, QuantizedWeight) and w.q.dtype == jnp.float8_e4m3fn and rows_form(spec, x, w)):
        return None
    q = w.q.reshape(w.shape[0], -1)  # [K, N]
    y = fp8.fp8_matmul(x, q, w.scale.reshape(-1), out_dtype=preferred_element_type or x.dtype)
    return y.reshape(x.shape[0], *w.shape[1:])
