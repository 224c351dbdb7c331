"""int8 weight-only quantization: symmetric per-output-channel scales, weights stored as int8 and de-quantized inside
the matmul (x @ q) * scale, which is exact per output channel. Norms, biases and the embedding stay in float."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_matmul

# Expert weights (experts_gate_up [E, hidden, 2, I], experts_down [E, I, hidden]) and the router stay in float:
# `quantize_weight` takes scales over axis 0, which for them is the expert axis, not the input axis; int8 experts need
# per-expert scales [E, *out] applied after the grouped matmul (models/moe.py), which it does not do.
QUANTIZABLE = ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")
METHODS = ("int8",)


@flax.struct.dataclass
class QuantizedWeight:
    q: jax.Array  # [in, *out] int8
    scale: jax.Array  # [*out] float32, one per output channel

    @property
    def shape(self):
        return self.q.shape


def quantize_weight(w: jax.Array) -> QuantizedWeight:
    """Per-output-channel symmetric int8 of a weight stored [in, *out] (the input axis is 0)."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)  # [*out]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q=q, scale=scale.astype(jnp.float32))


def quantize_params(params: dict, method: str = "int8") -> dict:
    """Quantize every projection of every layer and the lm_head (when loaded); everything else is kept as it is."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    layers = [{k: quantize_weight(v) if k in QUANTIZABLE else v for k, v in lp.items()} for lp in params["layers"]]
    out = {**params, "layers": layers}
    if "lm_head" in params:  # embedding-only parameters have none
        out["lm_head"] = quantize_weight(params["lm_head"])
    return out


MATMULS = ("xla", "cpu_rows")  # how float matmuls run: XLA's dot, or the CPU few-row kernel where it takes them


def _rows_form(spec: str | None, x: jax.Array, w: jax.Array) -> bool:
    """Whether x @ w (with `spec`) contracts x's last axis with w's first and keeps the rest in order: a plain
    [M, K] @ [K, N] once w's output axes are flattened."""
    if x.ndim != 2:
        return False
    if spec is None:
        return w.ndim == 2
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return len(ws) == w.ndim and xs[1] == ws[0] and out == xs[0] + ws[1:]


def _on_rows_kernel(x: jax.Array, w: jax.Array, spec: str | None) -> jax.Array | None:
    """x @ w on `cpu_matmul`'s few-row kernels when the product has their plain form and they take it (float32 x,
    decode-sized, w float32 or int8: preferred_element_type changes nothing), else None."""
    if not _rows_form(spec, x, w):
        return None
    w2 = w.reshape(w.shape[0], -1)  # [K, prod(out)]
    if not cpu_matmul.takes(x, w2):
        return None
    return cpu_matmul.rows_matmul(x, w2).reshape(x.shape[0], *w.shape[1:])


def matmul(x: jax.Array, w, spec: str | None = None, preferred_element_type=None, backend: str = "xla") -> jax.Array:
    """x @ w for a float or quantized weight; `spec` is an einsum spec for weights with several output axes.
    backend: one of MATMULS; "cpu_rows" runs float32 matmuls of few rows, and int8 weights' float32 matmuls of few
    rows, on `netra_jax.ops.cpu_matmul`'s kernels."""
    if backend not in MATMULS:
        raise ValueError(f"unknown matmul backend {backend!r}; available: {', '.join(MATMULS)}")
    if isinstance(w, QuantizedWeight):
        if backend == "cpu_rows" and (y := _on_rows_kernel(x, w.q, spec)) is not None:
            return y * w.scale  # the int8 weights read as they are
        wq = w.q.astype(x.dtype)
        y = (
            jnp.einsum(spec, x, wq, preferred_element_type=preferred_element_type)
            if spec
            else jnp.dot(x, wq, preferred_element_type=preferred_element_type)
        )
        return y * w.scale.astype(y.dtype)
    w = w.astype(x.dtype)
    if backend == "cpu_rows" and (y := _on_rows_kernel(x, w, spec)) is not None:
        return y
    if spec:
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)
