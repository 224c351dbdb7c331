"""Online quantization of a float checkpoint's parameters (`--quantization`, `LLM(quantization=)`): "int8" and "fp8"
(per-output-channel symmetric scales, `QuantizedWeight`) and "int4" (llama.cpp's Q4_0 blocks, `GGMLWeight`). Norms,
biases, the embedding, expert weights and the router stay as they are."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from netra_jax.ops import ggml_blocks
from netra_jax.quant.weights import GGMLWeight, QuantizedWeight, is_quantized

# Expert weights (experts_gate_up [E, hidden, 2, I], experts_down [E, I, hidden]) and the router stay in float:
# `quantize_weight` takes scales over axis 0, which for them is the expert axis, not the input axis; int8 experts need
# per-expert scales [E, *out] applied after the grouped matmul (models/moe.py), which it does not do.
QUANTIZABLE = ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")
METHODS = ("int8", "int4", "fp8")
_CHANNEL_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # storage dtype, largest value


@functools.partial(jax.jit, static_argnums=1)  # one program per weight shape, not one per operation
def quantize_weight(w: jax.Array, method: str = "int8") -> QuantizedWeight:
    """Per-output-channel symmetric int8 or fp8 (`method`) of a weight stored [in, *out] (the input axis is 0)."""
    dtype, top = _CHANNEL_FORMATS[method]
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)  # [*out]
    scale = jnp.where(amax > 0, amax / top, 1.0)
    if method == "int8":
        q = jnp.clip(jnp.round(wf / scale), -top, top).astype(dtype)
    else:  # fp8 rounds to nearest in the cast; |w / scale| <= 448, e4m3's largest finite value
        q = (wf / scale).astype(dtype)
    return QuantizedWeight(q=q, scale=scale.astype(jnp.float32))


def quantize_q4_0(w: jax.Array) -> GGMLWeight | None:
    """A weight [in, *out] as Q4_0 blocks along its input axis (`GGMLWeight`, de-quantizing to w's dtype), or None
    when its input size is not a multiple of 32."""
    if w.shape[0] % ggml_blocks.FORMATS["Q4_0"].qk:
        return None
    return GGMLWeight(_q4_0_rows(w), "Q4_0", tuple(w.shape), True, jnp.dtype(w.dtype))


@jax.jit
def _q4_0_rows(w: jax.Array) -> jax.Array:
    rows = w.reshape(w.shape[0], -1).T.astype(jnp.float32)  # [prod(out), in]: a row per output feature
    return ggml_blocks.quantize_rows_q4_0(rows)


def quantize_params(params: dict, method: str = "int8") -> dict:
    """Quantize every projection of every layer and the lm_head (when loaded) by `method` (one of METHODS, see the
    module docstring); everything else, and weights already quantized (a GGUF file's blocks), is kept as it is."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")

    def q(name: str, v):
        if name not in QUANTIZABLE or is_quantized(v):
            return v
        if method == "int4":
            blocks = quantize_q4_0(v)
            return v if blocks is None else blocks
        return quantize_weight(v, method)

    layers = [{k: q(k, v) for k, v in lp.items()} for lp in params["layers"]]
    out = {**params, "layers": layers}
    if "lm_head" in params:  # embedding-only parameters have none
        out["lm_head"] = q("wq", params["lm_head"])
    return out
