"""`load_format="dummy"` (vLLM's name): random parameters for a model described by its config.json alone, with the
structure, shapes and dtypes the Hugging Face loader produces, generated on the device (no weights read or copied).

The pytree comes from `parallel.ShardedHFReader.leaves` over a stand-in checkpoint of zero-copy broadcast views with
the tensor names and shapes a real checkpoint of this config has (`hf_tensor_shapes`), so it cannot drift from the
real loader; each leaf's dtype is read off a one-element read through the same code. Norm weights are ones, every
other tensor normal(0, 0.02) drawn by `jax.random` in a jitted function placed with the leaf's sharding (under
tensor parallelism each device draws only its own slice). Meant for benchmarks: the outputs are noise."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from netra_jax import parallel
from netra_jax.config import ModelConfig

LOAD_FORMATS = ("auto", "dummy")
INIT_STD = 0.02  # the HF initializer_range of Llama-style models


def hf_tensor_shapes(cfg: ModelConfig, biased: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Hugging Face checkpoint of this config (projections stored [out, in]); `biased`
    names the attention projections that carry a bias (see `attention_biases`)."""
    H, V, I, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    qs, ks = cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (qs, H),
            p + "self_attn.k_proj.weight": (ks, H),
            p + "self_attn.v_proj.weight": (ks, H),
            p + "self_attn.o_proj.weight": (H, qs),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        bias_size = {"q_proj": qs, "k_proj": ks, "v_proj": ks, "o_proj": H}
        shapes |= {p + f"self_attn.{name}.bias": (bias_size[name],) for name in biased}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (H,), p + "post_feedforward_layernorm.weight": (H,)}
    return shapes


def attention_biases(cfg: ModelConfig, hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The attention projections whose bias a checkpoint of this config carries: Qwen2's q/k/v always; with
    `attention_bias: true` (Llama, Mistral, ...) all four, o_proj included, as transformers builds them."""
    if hf_config.get("attention_bias", False):
        return ("q_proj", "k_proj", "v_proj", "o_proj")
    return ("q_proj", "k_proj", "v_proj") if cfg.family == "qwen2" else ()


def param_layout(cfg: ModelConfig, dtype, tp: int = 1, biased: tuple[str, ...] = ()) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct` leaves (KV heads expanded for a tp-way split, as loaded)."""
    shapes = hf_tensor_shapes(cfg, biased)
    zero = np.zeros((), np.float32)

    def get(name: str) -> np.ndarray:
        return np.broadcast_to(zero, shapes[name])  # a view: no memory behind the "checkpoint"

    leaves = parallel.ShardedHFReader(get, shapes.__contains__, cfg, dtype).leaves(tp)

    def struct(leaf) -> jax.ShapeDtypeStruct:
        probe = leaf.read(tuple(slice(0, 1) for _ in leaf.shape))  # one element through the real read path
        return jax.ShapeDtypeStruct(leaf.shape, probe.dtype)

    return jax.tree.map(struct, leaves, is_leaf=lambda x: isinstance(x, parallel._Leaf))


def _is_norm(path) -> bool:
    return str(getattr(path[-1], "key", "")).endswith("norm")


def random_params(
    cfg: ModelConfig,
    dtype,
    mesh: jax.sharding.Mesh | None = None,
    biased: tuple[str, ...] = (),
    seed: int = 0,
) -> dict:
    """Random parameters on the device (or sharded over `mesh`) with the layout of `param_layout`."""
    tp = parallel.tp_size(mesh)
    layout = param_layout(cfg, dtype, tp, biased)
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
