"""Tensor parallelism over a one-axis `jax.sharding` mesh ("tp"): the mesh, the PartitionSpecs of the paged KV cache,
KV-head expansion and the placement of parameters (whole, or read per device
slice from a HF checkpoint's memory maps). Each parameter's PartitionSpec lives with its entry in the weight map
(`models.weight_map`).

Layout (weights are stored [in, out], see `models.transformer`):

    wq/wk/wv [hidden, heads*head_dim] and their biases: column split by heads; wo [q_heads*head_dim, hidden]: row
    split (XLA all-reduces its partial sums); w_gate_up [hidden, 2, intermediate]: split on intermediate; w_down
    [intermediate, hidden]: row split (all-reduce); experts split on their intermediate axis the same way
    (experts_gate_up [E, hidden, 2, I], experts_down [E, I, hidden], experts_gate_up_bias [E, 2, I]), router and the
    other expert biases replicated; sinks [heads]: split with the query heads; embed [vocab, hidden] and lm_head
    [hidden, vocab]: split on vocab (the lookup is a masked local gather plus an all-reduce, the logits are
    all-gathered), replicated when the vocabulary does not divide by tp; norms, q/k norms and the wo bias:
    replicated. KV cache [pages, page_size, kv_heads, head_dim]: split on kv_heads, so attention runs per device on
    its own heads without moving KV.
Quantized weights split as the float parameters they stand for (`quant.shard_specs`): scales with the output axes,
GGML blocks by rows (an output axis split) or by whole blocks along K (K / tp a multiple of the format's block, else
refused naming the weight); `place_leaf` reads each device's rows or blocks of a GGUF file.
When num_kv_heads < tp (tp a multiple of it) every KV head is replicated tp / num_kv_heads times, as vLLM does:
the parameters and cache carry tp "expanded" KV heads (`shard_config`), one per device, each a copy of the head its
query heads use, so a device stores one KV head instead of all of them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from netra_jax.config import ConfigError, ModelConfig
from netra_jax.models.head_parallel import KV_PAGES
from netra_jax.models.weight_map import TP, Leaf, WeightReader, kv_params, param_specs
from netra_jax.models.weight_reads import BlocksLeaf, KeptLeaf
from netra_jax.ops.kv_quant import bytes_per_slot_head

LEAVES = (Leaf, BlocksLeaf, KeptLeaf)  # what a reader's pytree holds: floats read by slices, GGML blocks, or a
# quantized checkpoint's weights (read whole, on one device)


# ------------------------------------------------------------------------------------------ mesh and config
def make_mesh(tp: int, devices=None) -> Mesh:
    """A ("tp",) mesh over the first `tp` devices (in `jax.devices()` order, so device 0 is the one the sampler and
    other single-device code use), automatic axis type so XLA propagates shardings through the forward. The forward
    also takes parameters and pages placed on a mesh whose "tp" axis is Explicit (`jax.make_mesh(...,
    axis_types=(AxisType.Explicit,))`): it runs its layers there as on an Auto one (`models.head_parallel`)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (TP,), axis_types=(AxisType.Auto,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ConfigError when the model cannot be split `tp` ways."""
    if tp == 1:
        return
    kh = cfg.num_kv_heads
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads} is not divisible by it")
    if kh % tp and tp % kh:
        problems.append(f"num_kv_heads={kh} neither divides by it nor divides it")
    dense_layers = not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if dense_layers and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
    if cfg.num_experts and cfg.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by it")
    if problems:
        raise ConfigError(f"tensor_parallel_size={tp} does not fit the model: {'; '.join(problems)}")


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the tp-way split stores (1 unless num_kv_heads < tp)."""
    return max(1, tp // cfg.num_kv_heads)


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded forward runs with: KV heads expanded to tp when there are fewer of them than tp."""
    check_tp(cfg, tp)
    r = kv_replicas(cfg, tp)
    return cfg if r == 1 else cfg.replace(num_kv_heads=cfg.num_kv_heads * r)


def kv_bytes_per_page_per_device(cfg: ModelConfig, page_size: int, dtype, tp: int) -> int:
    """Bytes one KV page takes on each device (K and V, all layers) under a tp-way split, the scales of an int8 / fp8
    cache included."""
    heads = shard_config(cfg, tp).num_kv_heads // tp
    return 2 * cfg.num_layers * page_size * heads * bytes_per_slot_head(dtype, cfg.head_dim)


# ------------------------------------------------------------------------------------------ shardings
def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_PAGES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _repeat_kv_heads(a, head_dim: int, r: int) -> np.ndarray:
    """a [..., kv * head_dim] with each head repeated r times in place: [..., kv * r * head_dim] (host numpy)."""
    a = np.asarray(a)
    heads = a.reshape(a.shape[:-1] + (-1, head_dim))  # [..., kv, head_dim]
    return np.repeat(heads, r, axis=-2).reshape(a.shape[:-1] + (-1,))


def _expand_kv(lp: dict, cfg: ModelConfig, r: int) -> dict:
    """Repeat each KV head r times in wk/wv [hidden, kv*hd] and bk/bv [kv*hd] (host numpy)."""
    out = dict(lp)
    for k in kv_params(cfg):
        if k in lp and lp[k].shape[-1] == cfg.kv_size:
            out[k] = _repeat_kv_heads(lp[k], cfg.head_dim, r)
    return out


def expand_adapter_kv(adapter, head_dim: int, r: int):
    """A LoRA adapter (`models.lora.LoRAAdapter`) with each KV head of its k and v outputs (b's columns) repeated r
    times, as `shard_params` repeats the base model's when there are fewer KV heads than devices."""
    if r == 1:
        return adapter
    weights = {
        (layer, t): (a, _repeat_kv_heads(b, head_dim, r) if t in ("k", "v") else b)
        for (layer, t), (a, b) in adapter.weights.items()
    }
    return dataclasses.replace(adapter, weights=weights)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place a full parameter pytree (numpy or jax arrays) on the mesh: KV heads expanded when needed, each leaf
    with its NamedSharding (a device receives only its slice). Already placed leaves are left where they are."""
    tp = tp_size(mesh)
    check_tp(cfg, tp)
    r = kv_replicas(cfg, tp)
    if r > 1:
        params = {**params, "layers": [_expand_kv(lp, cfg, r) for lp in params["layers"]]}
    specs = param_specs(params, cfg, tp)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


# ------------------------------------------------------------------------------------------ sharded HF loading
def _norm_index(idx: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for sl, n in zip(idx, shape, strict=True):
        a, b, step = sl.indices(n)
        if step != 1:
            raise ValueError("strided shard index")
        out.append(slice(a, b))
    return tuple(out)


def sharded_leaves(get, has, cfg: ModelConfig, dtype, tp: int) -> tuple[WeightReader, dict]:
    """(reader, `Leaf` pytree) of a HF checkpoint for a tp-way split: KV heads expanded as `shard_params` does."""
    reader = WeightReader(cfg, get, has, dtype)
    return reader, reader.leaves(kv_replicas(cfg, tp))


def place_leaf(leaf: Leaf | BlocksLeaf, spec, mesh: Mesh):
    """One `Leaf` as a jax array placed with its NamedSharding on `mesh` (each device's callback reads only its
    slice from the memory maps), or a `BlocksLeaf` as a `GGMLWeight` whose blocks are placed so (`spec`: the
    GGMLWeight of its data's spec, from `param_specs`)."""
    if isinstance(leaf, BlocksLeaf):
        shape = leaf.template.data.shape
        data = jax.make_array_from_callback(
            shape, NamedSharding(mesh, spec.data), lambda idx: leaf.read(_norm_index(idx, shape))
        )
        return leaf.build(data)
    return jax.make_array_from_callback(
        leaf.shape, NamedSharding(mesh, spec), lambda idx: leaf.read(_norm_index(idx, leaf.shape))
    )


def place_leaves(leaves: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """The `Leaf` (and `BlocksLeaf`) pytree placed on `mesh` by `place_leaf`."""
    specs = param_specs(leaves, cfg, tp_size(mesh))
    return jax.tree.map(
        lambda leaf, spec: place_leaf(leaf, spec, mesh), leaves, specs, is_leaf=lambda x: isinstance(x, LEAVES)
    )


def load_hf_sharded(get, has, cfg: ModelConfig, dtype, mesh: Mesh) -> dict:
    """Sharded parameters of a HF checkpoint (getter/has as `HFCheckpoint` gives them), each device reading its
    slices only."""
    check_tp(cfg, tp_size(mesh))
    return place_leaves(sharded_leaves(get, has, cfg, dtype, tp_size(mesh))[1], cfg, mesh)
