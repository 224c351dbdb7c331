"""The jnp reference of `matmul` for every weight type: de-quantize, then XLA's dot. It is the ground truth the
kernels are tested against and the path for every product no backend kernel takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import ggml_blocks
from netra_jax.quant.weights import BlockFP8Weight, GGMLWeight, PackedIntWeight, PermutedWeight, QuantizedWeight


def rows_form(spec: str | None, x: jax.Array, w) -> bool:
    """Whether x @ w (with `spec`) contracts x's last axis with w's first and keeps the rest in order: a plain
    [M, K] @ [K, N] once w's output axes are flattened."""
    if x.ndim != 2:
        return False
    if spec is None:
        return w.ndim == 2
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return len(ws) == w.ndim and xs[1] == ws[0] and out == xs[0] + ws[1:]


def dot(x: jax.Array, w: jax.Array, spec: str | None, preferred_element_type) -> jax.Array:
    """x @ w for a float w (cast to x's dtype), by einsum `spec` when given."""
    w = w.astype(x.dtype)
    if spec:
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)


def reference_matmul(x: jax.Array, w, spec: str | None = None, preferred_element_type=None) -> jax.Array:
    """x @ w for a float or quantized weight, by de-quantizing in jnp (per-channel scales applied after the dot)."""
    if isinstance(w, PermutedWeight):
        x, w = w.inputs_in_stored_order(x, spec), w.stored
    if isinstance(w, QuantizedWeight) and w.batch_dims == 0:
        y = dot(x, w.q, spec, preferred_element_type)
        return y * w.scale.astype(y.dtype)
    if isinstance(w, GGMLWeight):
        return _ggml_reference(x, w, spec, preferred_element_type)
    if isinstance(w, (QuantizedWeight, PackedIntWeight, BlockFP8Weight)):
        return dot(x, w.dequantize(), spec, preferred_element_type)
    return dot(x, w, spec, preferred_element_type)


def _ggml_reference(x: jax.Array, w: GGMLWeight, spec: str | None, preferred_element_type) -> jax.Array:
    """GGML blocks de-quantized to x's dtype; in the plain form the rows [*out, K] are contracted on their K axis as
    they are (no transpose of the de-quantized weight, no reshape of a split output axis)."""
    if not w.transposed:
        raise ValueError(f"a {w.qtype} table read by rows (an embedding) is not a matmul weight")
    if rows_form(spec, x, w) and w.batch_dims == 0:
        r = ggml_blocks.dequantize_rows(w.data, w.qtype, x.dtype)  # [*out, K]
        contract = (((1,), (r.ndim - 1,)), ((), ()))
        return jax.lax.dot_general(x, r, contract, preferred_element_type=preferred_element_type)  # [M, *out]
    return dot(x, w.dequantize(), spec, preferred_element_type)
