"""The weight map on the mixture-of-experts fixtures (Qwen3-MoE, Mixtral, gpt-oss): every parameter's shape, dtype
and values against the safetensors tensors transformed by hand here (transposes, gate/up stacking, gpt-oss's
interleave undone), MXFP4 experts against hand-encoded blocks, per-device slice reads under tensor parallelism, and
large parameters read in blocks. tiny-gpt-oss's experts are square (hidden = intermediate = 64), so a copy with
intermediate 96 checks that no hidden/intermediate axis is swapped (tiny-qwen3-moe: 32 vs 64, tiny-mixtral: 96 vs
64 are not square)."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.checkpoints import FIXTURES

from netra_jax import parallel
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.loader import load_model
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models import weight_map, weight_reads
from netra_jax.models.weight_map import hf_to_params

MOE_MODELS = ("tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss")
# family -> (router, per-expert gate/up/down names under model.layers.<i>.) for the per-expert Linear layouts
LINEAR_EXPERTS = {
    "qwen3_moe": (
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
    ),
    "mixtral": ("block_sparse_moe.gate.weight", *(f"block_sparse_moe.experts.{{e}}.{w}" for w in ("w1", "w3", "w2"))),
}


def expected_params(cfg: ModelConfig, t: dict[str, np.ndarray]) -> dict:
    """The parameter pytree the contract describes, written out from the HF tensors `t`."""
    E = cfg.num_experts
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lp = {
            "attn_norm": t[p + "input_layernorm.weight"],
            "mlp_norm": t[p + "post_attention_layernorm.weight"],
            "wq": t[p + "self_attn.q_proj.weight"].T,
            "wk": t[p + "self_attn.k_proj.weight"].T,
            "wv": t[p + "self_attn.v_proj.weight"].T,
            "wo": t[p + "self_attn.o_proj.weight"].T,
        }
        for short, proj in (("bq", "q"), ("bk", "k"), ("bv", "v"), ("bo", "o")):
            if p + f"self_attn.{proj}_proj.bias" in t:
                lp[short] = t[p + f"self_attn.{proj}_proj.bias"]
        if cfg.qk_norm:
            lp["q_norm"], lp["k_norm"] = t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"]
        if cfg.family in LINEAR_EXPERTS:
            router, gate, up, down = (p + n for n in LINEAR_EXPERTS[cfg.family])
            lp["router"] = t[router].T  # [hidden, E]
            lp["experts_gate_up"] = np.stack(
                [
                    np.stack([t[gate.format(e=e) + ".weight"].T, t[up.format(e=e) + ".weight"].T], axis=1)
                    for e in range(E)
                ]
            )  # [E, hidden, 2, I]
            lp["experts_down"] = np.stack([t[down.format(e=e) + ".weight"].T for e in range(E)])  # [E, I, hidden]
        else:  # gpt-oss: fused [in, out] experts with interleaved gate/up columns
            gu, gu_b = t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.gate_up_proj_bias"]
            lp |= {
                "sinks": t[p + "self_attn.sinks"],
                "router": t[p + "mlp.router.weight"].T,
                "router_bias": t[p + "mlp.router.bias"],
                "experts_gate_up": np.stack([gu[..., 0::2], gu[..., 1::2]], axis=2),
                "experts_gate_up_bias": np.stack([gu_b[..., 0::2], gu_b[..., 1::2]], axis=1),
                "experts_down": t[p + "mlp.experts.down_proj"],
                "experts_down_bias": t[p + "mlp.experts.down_proj_bias"],
            }
        layers.append(lp)
    return {
        "embed": t["model.embed_tokens.weight"],
        "lm_head": t["lm_head.weight"].T,
        "final_norm": t["model.norm.weight"],
        "layers": layers,
    }


FLOAT32_PARAMS = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm", "sinks", "router_bias"}


def assert_params_are(params: dict, want: dict, dtype) -> None:
    """Every leaf of `params` has the structure, shape, dtype (float32 for norms, sinks and the router bias) and
    values of `want` (cast to that dtype)."""
    assert jax.tree.structure(params) == jax.tree.structure(want)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    for (path, got), ref in zip(flat, jax.tree.leaves(want), strict=True):
        key = str(getattr(path[-1], "key", ""))
        assert got.dtype == (np.float32 if key in FLOAT32_PARAMS else np.dtype(dtype)), path
        assert got.shape == ref.shape, path
        np.testing.assert_array_equal(np.asarray(got), ref.astype(got.dtype), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_checkpoint_loads_to_the_contract_pytree(name, dtype):
    cfg, params = load_model(FIXTURES / name, dtype, cache=False)
    assert_params_are(params, expected_params(cfg, load_file(FIXTURES / name / "model.safetensors")), dtype)
    lp = params["layers"][0]
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert lp["experts_gate_up"].shape == (E, H, 2, I) and lp["experts_down"].shape == (E, I, H)


NON_SQUARE_INTER = 96  # tiny-gpt-oss's hidden size is 64


def write_non_square_gpt_oss(d, stored=np.float32) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """tiny-gpt-oss in directory `d` with intermediate size 96 and random experts of the new shapes (gate_up_proj
    [E, 64, 192] interleaved, down_proj [E, 96, 64], their biases), every tensor stored as `stored` (float32 or
    bfloat16); returns its config and the tensors as stored, in float32."""
    shutil.copytree(FIXTURES / "tiny-gpt-oss", d, dirs_exist_ok=True)
    hf_cfg = json.loads((d / "config.json").read_text()) | {"intermediate_size": NON_SQUARE_INTER}
    (d / "config.json").write_text(json.dumps(hf_cfg))
    cfg = ModelConfig.from_hf_dir(d)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors = load_file(d / "model.safetensors")
    rng = np.random.default_rng(1)
    shapes = {
        "gate_up_proj": (E, H, 2 * I),
        "gate_up_proj_bias": (E, 2 * I),
        "down_proj": (E, I, H),
        "down_proj_bias": (E, H),
    }
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.mlp.experts.{name}"] = rng.standard_normal(shape, np.float32)
    tensors = {k: v.astype(stored) for k, v in tensors.items()}
    save_file(tensors, d / "model.safetensors")
    return cfg, {k: v.astype(np.float32) for k, v in tensors.items()}


@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_non_square_gpt_oss_experts(stored, tmp_path):
    cfg, tensors = write_non_square_gpt_oss(tmp_path, stored)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert (H, I) == (64, NON_SQUARE_INTER)
    for dtype in ("float32", "bfloat16"):
        _, params = load_model(tmp_path, dtype, cache=False)
        assert_params_are(params, expected_params(cfg, tensors), dtype)
        lp = params["layers"][1]
        assert lp["experts_gate_up"].shape == (E, H, 2, I) and lp["experts_gate_up_bias"].shape == (E, 2, I)
        assert lp["experts_down"].shape == (E, I, H) and lp["experts_down_bias"].shape == (E, H)
        gu = tensors["model.layers.1.mlp.experts.gate_up_proj"]  # [E, hidden, 2I]: gate in even columns
        np.testing.assert_array_equal(np.asarray(lp["experts_gate_up"][3, 5, 1, 7]), gu[3, 5, 15].astype(dtype))


def _encode_mxfp4(rng, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] with their values [..., G * 32], decoded by hand:
    byte k holds value 2k (low nibble) and 2k + 1 (high nibble); code bits: sign, 2 exponent, 1 mantissa."""
    codes = rng.integers(0, 16, size=(*shape, 32), dtype=np.uint8)  # [..., G, 32]
    scales = rng.integers(124, 130, size=shape, dtype=np.uint8)  # exponents 2**-3 .. 2**2
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    mag = codes & 7
    exp, man = mag >> 1, (mag & 1).astype(np.float64)
    value = np.where(exp == 0, man * 0.5, (1 + man / 2) * 2.0 ** (exp.astype(np.float64) - 1))
    value = np.where(codes & 8, -value, value) * 2.0 ** (scales.astype(np.float64)[..., None] - 127)
    return blocks, scales, value.reshape(*shape[:-1], shape[-1] * 32).astype(np.float32)


def write_mxfp4_gpt_oss(d, src=FIXTURES / "tiny-gpt-oss") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The gpt-oss checkpoint `src` (float32) in directory `d` with its experts stored as MXFP4 (as the published
    gpt-oss checkpoints are); returns its config and the tensors with the bf16-layout experts the blocks decode to:
    gate_up_proj [E, hidden, 2I] and down_proj [E, I, hidden]."""
    shutil.copytree(src, d, dirs_exist_ok=True)
    cfg = ModelConfig.from_hf_dir(d)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors = load_file(d / "model.safetensors")
    rng = np.random.default_rng(0)
    for i in range(cfg.num_layers):
        x = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks, scales, value = _encode_mxfp4(rng, (E, rows, cols // 32))  # value: [E, rows, cols] ([out, in])
            del tensors[x + name]
            tensors[x + name + "_blocks"], tensors[x + name + "_scales"] = blocks, scales
            tensors[x + name] = np.ascontiguousarray(value.swapaxes(1, 2))  # the bf16 checkpoint's [E, in, out]
    decoded = dict(tensors)
    stored = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file(stored, d / "model.safetensors")
    return cfg, decoded


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return d, *write_mxfp4_gpt_oss(d)


@pytest.fixture(scope="module")
def mxfp4_non_square(tmp_path_factory):
    """The non-square gpt-oss (intermediate 96) with MXFP4 experts: 3 groups of 32 per down_proj row."""
    src = tmp_path_factory.mktemp("gpt-oss-96")
    write_non_square_gpt_oss(src)
    d = tmp_path_factory.mktemp("gpt-oss-96-mxfp4")
    return d, *write_mxfp4_gpt_oss(d, src)


@pytest.mark.parametrize("checkpoint", ["mxfp4_gpt_oss", "mxfp4_non_square"])
def test_mxfp4_experts_are_dequantized_at_load(checkpoint, request):
    d, cfg, decoded = request.getfixturevalue(checkpoint)
    assert not HFCheckpoint(d).has("model.layers.0.mlp.experts.gate_up_proj_unknown")
    _, params = load_model(d, "float32", cache=False)
    want = expected_params(cfg, decoded)
    for got, ref in zip(params["layers"], want["layers"], strict=True):
        for key in ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias"):
            np.testing.assert_array_equal(np.asarray(got[key]), ref[key], err_msg=key)
    _, bf16 = load_model(d, "bfloat16", cache=False)
    assert bf16["layers"][0]["experts_down"].dtype == ml_dtypes.bfloat16


def _assert_slices_read_alone(cfg, ck, tp: int) -> int:
    """Each device's slice of every leaf equals that slice of the whole conversion and reads only the slice's
    bytes of float32 sources (no more than the covering 32-value groups of MXFP4 ones); returns the number of
    split leaves."""
    full = hf_to_params(cfg, ck.get, ck.has, np.float32)
    reader, leaves = parallel.sharded_leaves(ck.get, ck.has, cfg, np.float32, tp)
    specs = parallel.param_specs(leaves, cfg, tp)
    flat_l, tree = jax.tree.flatten(leaves, is_leaf=lambda x: isinstance(x, weight_map.Leaf))
    n_split = 0
    for leaf, want, spec in zip(flat_l, tree.flatten_up_to(full), tree.flatten_up_to(specs), strict=True):
        axis = next((i for i, s in enumerate(spec) if s == parallel.TP), None)
        n_split += axis is not None
        for dev in range(tp if axis is not None else 1):
            idx = [slice(0, n) for n in want.shape]
            if axis is not None:
                n = want.shape[axis] // tp
                idx[axis] = slice(dev * n, (dev + 1) * n)
            reader.reads.log.clear()
            got = leaf.read(tuple(idx))
            np.testing.assert_array_equal(got, want[tuple(idx)])
            assert sum(b for _, _, b in reader.reads.log) == got.nbytes
    return n_split


@pytest.mark.parametrize("name", MOE_MODELS)
def test_experts_split_on_the_intermediate_axis_read_per_device(name):
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    n_split = _assert_slices_read_alone(cfg, HFCheckpoint(FIXTURES / name), tp=2)
    # embed, lm_head; per layer wq wk wv wo experts_gate_up experts_down (+ gpt-oss: bq bk bv sinks and the gate/up
    # bias; its o_proj bias, router and down bias are replicated)
    assert n_split == 2 + cfg.num_layers * (11 if name == "tiny-gpt-oss" else 6)
    specs = {e.param: e.spec for e in weight_map.TABLES[cfg.family]}
    assert specs["experts_gate_up"] == (None, None, None, "tp") and specs["experts_down"] == (None, "tp", None)
    assert specs["router"] == ()


@pytest.mark.parametrize("checkpoint", ["mxfp4_gpt_oss", "mxfp4_non_square"])
def test_mxfp4_slices_read_per_device(checkpoint, request):
    d, cfg, _ = request.getfixturevalue(checkpoint)
    assert _assert_slices_read_alone(cfg, HFCheckpoint(d), tp=2) == 2 + cfg.num_layers * 11


SMALL_BLOCK = 3000  # bytes: one expert per block, row blocks that do not align with heads or groups of 32


def _read_in_blocks(cfg, ck, budget: int) -> tuple[dict, list]:
    """The whole parameter pytree read with blocks of `budget` bytes, and the log of source reads."""
    old, weight_reads.BLOCK_BYTES = weight_reads.BLOCK_BYTES, budget
    try:
        reader = weight_map.WeightReader(cfg, ck.get, ck.has, np.float32)
        leaves = reader.leaves()
        params = jax.tree.map(lambda leaf: leaf.read_all(), leaves, is_leaf=lambda x: isinstance(x, weight_map.Leaf))
    finally:
        weight_reads.BLOCK_BYTES = old
    return params, reader.reads.log


@pytest.mark.parametrize("checkpoint", [*MOE_MODELS, "mxfp4_gpt_oss", "mxfp4_non_square"])
def test_large_parameters_are_read_in_blocks(checkpoint, request):
    """A read larger than weight_reads.BLOCK_BYTES goes block by block (gpt-oss's experts one at a time instead of
    de-quantizing all of a layer's) into one array, with the same values."""
    if checkpoint in MOE_MODELS:
        d = FIXTURES / checkpoint
        cfg, tensors = ModelConfig.from_hf_dir(d), load_file(d / "model.safetensors")
    else:
        d, cfg, tensors = request.getfixturevalue(checkpoint)
    ck = HFCheckpoint(d)
    params, log = _read_in_blocks(cfg, ck, SMALL_BLOCK)
    assert_params_are(params, expected_params(cfg, tensors), np.float32)
    _, whole_log = _read_in_blocks(cfg, ck, weight_reads.BLOCK_BYTES)
    if cfg.family == "gpt_oss":  # fused [E, hidden, 2I] experts: one expert per read, all at once by default

        def experts_per_read(log: list) -> set[int]:
            return {shape[0] for name, shape, _ in log if name.endswith(("gate_up_proj", "down_proj"))}

        assert experts_per_read(log) == {1} and experts_per_read(whole_log) == {cfg.num_experts}
    assert max(b for _, _, b in log) <= max(SMALL_BLOCK, 4 * cfg.hidden_size * 2 * cfg.moe_intermediate_size)
    assert len(log) > len(whole_log)


def test_check_tp_counts_the_expert_width():
    cfg = ModelConfig.from_hf_dir(FIXTURES / "tiny-qwen3-moe")  # moe_intermediate_size 32, intermediate 128
    parallel.check_tp(cfg, 2)
    with pytest.raises(ConfigError, match="moe_intermediate_size=34 is not divisible"):
        parallel.check_tp(cfg.replace(moe_intermediate_size=34), 4)
    # all layers routed: the dense width is not split, so it need not divide
    parallel.check_tp(cfg.replace(intermediate_size=129), 2)
    with pytest.raises(ConfigError, match="intermediate_size=129"):
        parallel.check_tp(cfg.replace(intermediate_size=129, moe_layers=(False, True)), 2)


def test_bad_moe_checkpoints_say_what_is_wrong(tmp_path):
    shutil.copytree(FIXTURES / "tiny-mixtral", tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(weight_map.WeightError, match="lacks tensor 'model.layers.1.block_sparse_moe.experts.3.w3"):
        load_model(tmp_path, cache=False)
    cfg = json.loads((tmp_path / "config.json").read_text()) | {"num_local_experts": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(weight_map.WeightError, match=r"block_sparse_moe.gate.weight' has shape \(4, 64\)"):
        load_model(tmp_path, cache=False)
