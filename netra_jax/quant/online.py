"""Online quantization of a float checkpoint's parameters (`--quantization`, `LLM(quantization=)`): "int8" and "fp8"
(per-output-channel symmetric scales, `QuantizedWeight`) and "int4" (llama.cpp's Q4_0 blocks, `GGMLWeight`) of the
projections, the lm_head and the MoE experts (per expert); norms, biases, the embedding and the router stay as they
are. A weight split over a tensor-parallel mesh is quantized where it lies, each device its own shard."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from netra_jax.ops import ggml_blocks
from netra_jax.quant.weights import GGMLWeight, QuantizedWeight, is_quantized, shard_specs

# parameter -> leading axes before its input axis: the experts (experts_gate_up [E, hidden, 2, I], experts_down
# [E, I, hidden]) have one, so their scales and blocks are per expert (scales [E, *out], applied after the grouped
# matmul in models/moe.py). The router stays in float.
BATCH_DIMS = {
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "wo": 0,
    "w_gate_up": 0,
    "w_up": 0,
    "w_down": 0,
    "experts_gate_up": 1,
    "experts_down": 1,
}
QUANTIZABLE = tuple(BATCH_DIMS)
METHODS = ("int8", "int4", "fp8")
_CHANNEL_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # storage dtype, largest value


@functools.partial(jax.jit, static_argnums=(1, 2))  # one program per weight shape, not one per operation
def quantize_weight(w: jax.Array, method: str = "int8", batch_dims: int = 0) -> QuantizedWeight:
    """Per-output-channel symmetric int8 or fp8 (`method`) of a weight stored [*batch, in, *out] (the input axis
    follows `batch_dims` leading axes, e.g. the experts: a scale per expert and output channel)."""
    dtype, top = _CHANNEL_FORMATS[method]
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=batch_dims, keepdims=True)  # [*batch, 1, *out]
    scale = jnp.where(amax > 0, amax / top, 1.0)
    if method == "int8":
        q = jnp.clip(jnp.round(wf / scale), -top, top).astype(dtype)
    else:  # fp8 rounds to nearest in the cast; |w / scale| <= 448, e4m3's largest finite value
        q = (wf / scale).astype(dtype)
    return QuantizedWeight(q=q, scale=jnp.squeeze(scale, batch_dims).astype(jnp.float32), batch_dims=batch_dims)


def quantize_q4_0(w: jax.Array, batch_dims: int = 0) -> GGMLWeight | None:
    """A weight [*batch, in, *out] as Q4_0 blocks along its input axis (`GGMLWeight`, de-quantizing to w's dtype),
    or None when its input size is not a multiple of 32."""
    if w.shape[batch_dims] % ggml_blocks.FORMATS["Q4_0"].qk:
        return None
    return _q4_0(w, batch_dims)


@functools.partial(jax.jit, static_argnums=1)
def _q4_0(w: jax.Array, batch_dims: int) -> GGMLWeight:
    rows = jnp.moveaxis(w, batch_dims, -1).astype(jnp.float32)  # [*batch, *out, in]: a row per output feature
    data = ggml_blocks.quantize_rows_q4_0(rows)  # [*batch, *out, row_bytes]
    return GGMLWeight(data, "Q4_0", True, jnp.dtype(w.dtype), batch_dims)


def _quantizer(method: str, batch_dims: int):
    """The function quantizing one weight by `method` (None from it: kept in float)."""
    if method == "int4":
        return functools.partial(quantize_q4_0, batch_dims=batch_dims)
    return functools.partial(quantize_weight, method=method, batch_dims=batch_dims)


def _quantize(name: str, w, method: str, batch_dims: int):
    """`w` quantized by `method` (None: kept in float); a weight split over a mesh is quantized by
    `sharded_quantizer`, each device its own shard."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return _quantizer(method, batch_dims)(w)
    fn = sharded_quantizer(name, w, method, batch_dims)
    return w if fn is None else fn(w)


def sharded_quantizer(name: str, w: jax.Array, method: str, batch_dims: int = 0):
    """The jitted quantizer of `w`, an array split over a mesh by a NamedSharding, whose outputs are split the same
    way (`shard_specs`: scales with the output axes, blocks by rows or whole blocks along K; ValueError naming
    `name` when the blocks cannot be): elementwise per shard, plus one all-reduce of the per-channel maxima when the
    input axis is split; the weight is never gathered. None when the method keeps it in float."""
    fn = _quantizer(method, batch_dims)
    abstract = jax.eval_shape(fn, w)
    if abstract is None:
        return None
    mesh, spec = w.sharding.mesh, w.sharding.spec
    specs = shard_specs(abstract, spec, mesh.size, name)
    return jax.jit(fn, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def quantize_params(params: dict, method: str = "int8") -> dict:
    """Quantize every projection and expert weight of every layer and the lm_head (when loaded) by `method` (one of
    METHODS, see the module docstring); everything else, and weights already quantized (a GGUF file's blocks), is
    kept as it is (so is an int4 weight whose input size is not a multiple of 32). Weights placed on a
    tensor-parallel mesh are quantized per shard (see `_quantize`)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")

    def q(name: str, v, path: str):
        if name not in BATCH_DIMS or is_quantized(v):
            return v
        out = _quantize(path, v, method, BATCH_DIMS[name])
        return v if out is None else out

    layers = [{k: q(k, v, f"layers.{i}.{k}") for k, v in lp.items()} for i, lp in enumerate(params["layers"])]
    out = {**params, "layers": layers}
    if "lm_head" in params:  # embedding-only parameters have none
        out["lm_head"] = q("wq", params["lm_head"], "lm_head")
    return out
