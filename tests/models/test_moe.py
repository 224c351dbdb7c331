"""Mixture-of-experts MLP (models/moe.py) on the loaded fixture parameters against a float64 numpy reference of each
family's MoE block written from transformers' modeling code and the checkpoints' own HF tensors: routing rules,
expert layouts, biases and the clamped SwiGLU; one compilation for any routing; a token's output independent of the
other tokens in the step."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from support.checkpoints import FIXTURES, MOE_MODELS
from support.compiles import compiled_jits

from netra_jax.config import ModelConfig
from netra_jax.loader import load_model
from netra_jax.models.moe import MOE_KEYS, _grouped_matmul_blocks, grouped_matmul, moe_mlp, route

LAYER = 1


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.exp(-a))


def reference_moe(name: str, x: np.ndarray, cfg: ModelConfig, layer: int = LAYER) -> np.ndarray:
    """transformers' MoE block of `layer` in float64, read straight from the HF tensors. x: [T, hidden]."""
    t = {k: v.astype(np.float64) for k, v in load_file(FIXTURES / name / "model.safetensors").items()}
    p = f"model.layers.{layer}."
    k = cfg.num_experts_per_tok
    out = np.zeros_like(x)
    if cfg.family == "gpt_oss":  # top-k of the biased logits, softmax over those k
        logits = x @ t[p + "mlp.router.weight"].T + t[p + "mlp.router.bias"]
        idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        w = _softmax(np.take_along_axis(logits, idx, -1))
        gu_w, gu_b = t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.gate_up_proj_bias"]
        d_w, d_b = t[p + "mlp.experts.down_proj"], t[p + "mlp.experts.down_proj_bias"]
        for i in range(x.shape[0]):
            for j, e in enumerate(idx[i]):
                gu = x[i] @ gu_w[e] + gu_b[e]
                gate, up = np.minimum(gu[::2], cfg.swiglu_limit), np.clip(gu[1::2], -cfg.swiglu_limit, cfg.swiglu_limit)
                h = (up + 1) * gate / (1 + np.exp(-gate * cfg.swiglu_alpha))
                out[i] += w[i, j] * (h @ d_w[e] + d_b[e])
        return out
    # Qwen3-MoE and Mixtral: softmax over all experts, top-k, renormalised if norm_topk_prob
    mixtral = cfg.family == "mixtral"
    gate_name = p + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight")
    probs = _softmax(x @ t[gate_name].T)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, idx, -1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    for i in range(x.shape[0]):
        for j, e in enumerate(idx[i]):
            q = p + (f"block_sparse_moe.experts.{e}." if mixtral else f"mlp.experts.{e}.")
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            g, u, d = (t[q + n + ".weight"] for n in names)
            out[i] += w[i, j] * ((_silu(x[i] @ g.T) * (x[i] @ u.T)) @ d.T)
    return out


@functools.cache
def _loaded(name: str) -> dict:
    return load_model(FIXTURES / name, "float32", cache=False)[1]


def moe_params(name: str, layer: int = LAYER) -> dict:
    """The MoE parameters of `layer` as the loader builds them from the checkpoint (the weight map's layout)."""
    return {k: v for k, v in _loaded(name)["layers"][layer].items() if k in MOE_KEYS}


def _tokens(cfg: ModelConfig, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, cfg.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_matches_float64_reference(name):
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    x = _tokens(cfg, 40)
    got = np.asarray(jax.jit(moe_mlp, static_argnums=2)(jnp.asarray(x), moe_params(name), cfg))
    want = reference_moe(name, x.astype(np.float64), cfg)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    _, experts = route(jnp.asarray(x), moe_params(name), cfg)
    assert len(np.unique(np.asarray(experts))) == cfg.num_experts  # every expert has rows: all groups exercised


def test_unnormalised_top_k():
    """norm_topk_prob false (some Qwen3-MoE checkpoints): the top-k probabilities are used as they are."""
    name = "tiny-qwen3-moe"
    cfg = ModelConfig.from_hf_dir(FIXTURES / name).replace(norm_topk_prob=False)
    x = _tokens(cfg, 16, seed=1)
    got = np.asarray(moe_mlp(jnp.asarray(x), moe_params(name), cfg))
    want = reference_moe(name, x.astype(np.float64), cfg)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    normalised = reference_moe(name, x.astype(np.float64), cfg.replace(norm_topk_prob=True))
    assert np.abs(normalised - want).max() > 1e-2  # the flag changes the result


def test_one_compilation_for_any_routing():
    name = "tiny-qwen3-moe"
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    params = moe_params(name)
    f = jax.jit(moe_mlp, static_argnums=2)
    x = _tokens(cfg, 24, seed=2)
    skewed = np.repeat(x[:1], 24, axis=0)  # every token to the same two experts: the others get no rows
    routes = [np.asarray(route(jnp.asarray(a), params, cfg)[1]) for a in (x, skewed)]
    assert len(np.unique(routes[1])) == 2 and len(np.unique(routes[0])) > 2
    with compiled_jits() as compiled:
        f(jnp.asarray(x), params, cfg).block_until_ready()
        first = compiled.count("moe_mlp")
        got = np.asarray(f(jnp.asarray(skewed), params, cfg))
    assert first == 1 and compiled.count("moe_mlp") == 1  # the second routing compiled nothing
    want = reference_moe(name, skewed.astype(np.float64), cfg)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", MOE_MODELS)
def test_token_output_independent_of_companions(name):
    """A token's output is the same alone, among 64 others, and with the others' routing changed."""
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    params = moe_params(name)
    f = jax.jit(moe_mlp, static_argnums=2)
    x = _tokens(cfg, 64, seed=3)
    batch = np.asarray(f(jnp.asarray(x), params, cfg))
    others = x.copy()
    others[1:] = _tokens(cfg, 63, seed=4)
    mixed = np.asarray(f(jnp.asarray(others), params, cfg))
    alone = np.asarray(f(jnp.asarray(x[:1]), params, cfg))
    np.testing.assert_array_equal(mixed[0], batch[0])  # same shape, other companions: bitwise
    assert np.abs(alone[0] - batch[0]).max() <= 1e-6 * max(1.0, np.abs(batch[0]).max())


@pytest.mark.parametrize("rows", [1, 2, 17, 130])
def test_grouped_matmul(rows):
    """Both implementations (ragged_dot, the CPU block loop) against numpy, with empty and uneven groups; on CPU the
    compiled product is the block loop, not ragged_dot's masked product over every group."""
    rng = np.random.default_rng(rows)
    G, K, N = 5, 24, 40
    sizes = np.bincount(np.sort(rng.integers(0, G, rows)) if rows > 2 else [1, 3][:rows], minlength=G)
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = rng.normal(size=(G, K, N)).astype(np.float32)
    group = np.repeat(np.arange(G), sizes)
    want = np.einsum("rk,rkn->rn", x.astype(np.float64), w[group].astype(np.float64))
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32))
    for fn in (jax.lax.ragged_dot, _grouped_matmul_blocks, grouped_matmul):
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(*args)), want, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(grouped_matmul).lower(*args).as_text()
    assert "while" in hlo and f"{G}x{rows}x{K}" not in hlo  # no [groups, rows, K] masked copy of the rows


def test_gpu_lowering_uses_the_grouped_matmul_kernel():
    """Lowered for an (abstract) H200, the experts are the Pallas grouped-matmul kernel (two calls: gate/up and down),
    neither XLA's ragged dot (a masked product with every expert on GPU) nor the CPU block loop."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    name = "tiny-gpt-oss"
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    x = jax.ShapeDtypeStruct((16, cfg.hidden_size), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=gpu)):
        hlo = jax.jit(moe_mlp, static_argnums=2).trace(x, moe_params(name), cfg).lower(lowering_platforms=("cuda",))
    text = hlo.as_text()
    assert "ragged_dot" not in text and "stablehlo.while" not in text
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2


def test_moe_config_fields_follow_transformers_defaults():
    """Qwen3-MoE renormalises the top-k only when its config says so (transformers' default is False); dense layers
    come from mlp_only_layers and decoder_sparse_step; Mixtral and gpt-oss always renormalise."""
    d = json.loads((FIXTURES / "tiny-qwen3-moe" / "config.json").read_text())
    assert ModelConfig.from_hf_dict(d).norm_topk_prob is True  # the fixture sets it
    d.pop("norm_topk_prob")
    assert ModelConfig.from_hf_dict(d).norm_topk_prob is False
    d.update(num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    assert ModelConfig.from_hf_dict(d).moe_layers == (False, True, False, True, False, True)
    for name in ("tiny-mixtral", "tiny-gpt-oss"):
        d = json.loads((FIXTURES / name / "config.json").read_text())
        assert ModelConfig.from_hf_dict(d | {"norm_topk_prob": False}).norm_topk_prob is True
    d = json.loads((FIXTURES / "tiny-gpt-oss" / "config.json").read_text())
    with pytest.raises(ValueError, match="expert activation"):
        ModelConfig.from_hf_dict(d).replace(expert_act="gelu")
