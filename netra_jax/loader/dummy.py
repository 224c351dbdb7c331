"""`load_format="dummy"` (vLLM's name): random parameters for a model described by its config.json alone, with the
structure, shapes and dtypes the Hugging Face loader produces, generated on the device (no weights read or copied).

The pytree comes from the weight map's builder (`models.weight_map.WeightReader`) over a stand-in checkpoint of
zero-copy broadcast views with the tensor names and shapes the same table says a real checkpoint of this config has
(`weight_map.hf_shapes`), so it cannot drift from the real loader. Norm weights are ones, every other tensor
normal(0, 0.02) drawn by `jax.random` in a jitted function placed with the leaf's sharding (under tensor
parallelism each device draws only its own slice). Meant for benchmarks: the outputs are noise."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from netra_jax import parallel
from netra_jax.config import ModelConfig
from netra_jax.models import weight_map

INIT_STD = 0.02  # the HF initializer_range of Llama-style models


def attention_biases(cfg: ModelConfig, hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The attention biases (parameter names) a checkpoint of this config carries: Qwen2's q/k/v always; with
    `attention_bias: true` (Llama, Mistral, gpt-oss, ...) all four, o_proj included, as transformers builds them."""
    if hf_config.get("attention_bias", False):
        return ("bq", "bk", "bv", "bo")
    return ("bq", "bk", "bv") if cfg.family == "qwen2" else ()


def param_layout(cfg: ModelConfig, dtype, tp: int = 1, optional: tuple[str, ...] = ()) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct` leaves (KV heads expanded for a tp-way split, as loaded);
    `optional` names the optional parameters present (see `attention_biases`)."""
    shapes = weight_map.hf_shapes(cfg, optional)
    zero = np.zeros((), np.float32)

    def get(name: str) -> np.ndarray:
        return np.broadcast_to(zero, shapes[name])  # a view: no memory behind the "checkpoint"

    _, leaves = parallel.sharded_leaves(get, shapes.__contains__, cfg, dtype, tp)
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype),
        leaves,
        is_leaf=lambda x: isinstance(x, weight_map.Leaf),
    )


def _is_norm(path) -> bool:
    return str(getattr(path[-1], "key", "")).endswith("norm")


def random_params(
    cfg: ModelConfig,
    dtype,
    mesh: jax.sharding.Mesh | None = None,
    optional: tuple[str, ...] = (),
    seed: int = 0,
) -> dict:
    """Random parameters on the device (or sharded over `mesh`) with the layout of `param_layout`."""
    tp = parallel.tp_size(mesh)
    layout = param_layout(cfg, dtype, tp, optional)
    if mesh is None:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, layout)
    else:
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), parallel.param_specs(layout, cfg, tp))
    key = jax.random.key(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(layout)
    out = []
    for i, ((path, s), sharding) in enumerate(zip(flat, jax.tree.leaves(shardings), strict=True)):
        fill = _fill("ones" if _is_norm(path) else "normal", s.shape, jnp.dtype(s.dtype), sharding)
        out.append(fill(jax.random.fold_in(key, i)))
    params = jax.tree_util.tree_unflatten(treedef, out)
    if cfg.tie_word_embeddings:  # a tied checkpoint's lm_head is the embedding, transposed
        params["lm_head"] = jax.jit(jnp.transpose, out_shardings=shardings["lm_head"])(params["embed"])
    return params


@functools.cache
def _fill(kind: str, shape: tuple[int, ...], dtype, sharding):
    """A jitted key -> array of this shape: ones, or normal(0, INIT_STD) drawn in `dtype` on the device."""

    def normal(key):
        return jax.random.normal(key, shape, dtype) * jnp.asarray(INIT_STD, dtype)

    def ones(key):
        return jnp.ones(shape, dtype)

    return jax.jit(normal if kind == "normal" else ones, out_shardings=sharding)
