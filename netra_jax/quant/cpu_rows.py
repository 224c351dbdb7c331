"""The "cpu_rows" matmul backend: decode-sized float32 products on the CPU FFI kernels, float32 and int8 weights on
`ops.cpu_matmul`'s few-row kernels and GGML blocks on `ops.cpu_ggml_matmul`'s. Returns None for a product they do not
take (the entry point then runs the reference)."""

from __future__ import annotations

import jax

from netra_jax.ops import cpu_ggml_matmul, cpu_matmul
from netra_jax.quant.reference import rows_form
from netra_jax.quant.weights import GGMLWeight, QuantizedWeight, is_quantized


def cpu_rows_matmul(x: jax.Array, w, spec: str | None, preferred_element_type) -> jax.Array | None:
    """x @ w on the CPU kernels when the product has their plain form ([M, K] @ [K, *out]) and they take it
    (float32 x of few rows; preferred_element_type changes nothing for them), else None."""
    if not rows_form(spec, x, w):
        return None
    if isinstance(w, GGMLWeight):
        rows = w.data.reshape(-1, w.data.shape[-1])  # [N, row_bytes]: the output axes flattened
        if not (w.transposed and w.batch_dims == 0 and cpu_ggml_matmul.takes(x, rows, w.qtype)):
            return None
        y = cpu_ggml_matmul.blocks_matmul(x, rows, w.qtype)  # [M, N] float32
        return y.reshape(x.shape[0], *w.shape[1:])
    if isinstance(w, QuantizedWeight) and w.batch_dims == 0:
        y = _few_rows(x, w.q)
        return None if y is None else y * w.scale  # the int8 weights read as they are
    if is_quantized(w):  # no CPU kernel for its format
        return None
    return _few_rows(x, w.astype(x.dtype))


def _few_rows(x: jax.Array, w: jax.Array) -> jax.Array | None:
    w2 = w.reshape(w.shape[0], -1)  # [K, prod(out)]
    if not cpu_matmul.takes(x, w2):
        return None
    return cpu_matmul.rows_matmul(x, w2).reshape(x.shape[0], *w.shape[1:])
