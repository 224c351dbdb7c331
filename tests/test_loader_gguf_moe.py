"""Mixture-of-experts GGUF files (qwen3moe, Mixtral as arch llama, gpt-oss incl. MXFP4 experts) written the way
llama.cpp's converter writes them (tests/hf_to_gguf.py) load to the same config and parameters as their Hugging Face
directories, through the same weight map."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import FIXTURES
from hf_to_gguf import to_gguf
from test_loader import CFG_FIELDS
from test_weight_map import write_mxfp4_gpt_oss

from netra_jax.loader import load_model
from netra_jax.loader.gguf_config import config_from_gguf_metadata
from netra_jax.loader.gguf_loader import GGUFFile


def assert_same_model(gguf_path, hf_dir) -> None:
    cfg_g, p_g = load_model(gguf_path, "float32", cache=False)
    cfg_h, p_h = load_model(hf_dir, "float32", cache=False)
    assert {f: getattr(cfg_g, f) for f in CFG_FIELDS} == {f: getattr(cfg_h, f) for f in CFG_FIELDS}
    assert cfg_g.architecture == cfg_h.architecture
    assert jax.tree.structure(p_g) == jax.tree.structure(p_h)
    flat, _ = jax.tree_util.tree_flatten_with_path(p_g)
    for (path, a), b in zip(flat, jax.tree.leaves(p_h), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "name,variant",
    [
        ("tiny-qwen3-moe", "merged"),
        ("tiny-qwen3-moe", "fused"),
        ("tiny-mixtral", "merged"),
        ("tiny-mixtral", "per_expert"),
        ("tiny-gpt-oss", "merged"),
        ("tiny-gpt-oss", "fused"),
    ],
)
def test_moe_gguf_loads_like_its_hf_directory(name, variant, tmp_path):
    path = to_gguf(
        FIXTURES / name,
        tmp_path / f"{name}.gguf",
        fuse_gate_up=variant == "fused",
        per_expert_tensors=variant == "per_expert",
    )
    names = set(GGUFFile(path).tensors)
    expected = {
        "merged": "blk.0.ffn_gate_exps.weight",
        "fused": "blk.0.ffn_gate_up_exps.weight",
        "per_expert": "blk.0.ffn_gate.3.weight",
    }[variant]
    assert expected in names and "blk.0.ffn_gate_inp.weight" in names  # the layout under test is the file's
    assert_same_model(path, FIXTURES / name)


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_gguf_with_mxfp4_experts(fused, tmp_path):
    """llama.cpp repacks gpt-oss's MXFP4 blocks into GGML's MXFP4 type without de-quantizing: the GGUF experts
    de-quantize (gguf.quants) to exactly the HF MXFP4 checkpoint's."""
    d = tmp_path / "hf"
    write_mxfp4_gpt_oss(d)
    path = to_gguf(d, tmp_path / "gpt-oss-mxfp4.gguf", fuse_gate_up=fused)
    types = {t.qtype.name for n, t in GGUFFile(path).tensors.items() if "_exps.weight" in n}
    assert types == {"MXFP4"}
    assert_same_model(path, d)


def _qwen3moe_meta(n_layers: int, arch: str = "qwen3moe") -> dict:
    return {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.attention.head_count": 4,
        f"{arch}.block_count": n_layers,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.expert_feed_forward_length": 32,
        f"{arch}.expert_count": 8,
        f"{arch}.expert_used_count": 2,
    }


def test_gguf_moe_config_keys():
    shapes = {"token_embd.weight": (512, 64)}
    shapes |= {f"blk.{i}.ffn_gate_inp.weight": (8, 64) for i in (1, 3)}  # layers 0 and 2: dense MLPs
    cfg = config_from_gguf_metadata(_qwen3moe_meta(4), shapes)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("Qwen3MoeForCausalLM", 8, 2)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.norm_topk_prob) == (32, 128, True)
    assert cfg.moe_layers == (False, True, False, True)
    meta = _qwen3moe_meta(2) | {"qwen3moe.expert_weights_norm": False}
    assert config_from_gguf_metadata(meta, {"token_embd.weight": (512, 64)}).norm_topk_prob is False
    llama = _qwen3moe_meta(2, "llama")
    cfg = config_from_gguf_metadata(llama, {"token_embd.weight": (512, 64)})
    assert (cfg.architecture, cfg.family, cfg.moe_layers) == ("MixtralForCausalLM", "mixtral", (True, True))
    dense = {k: v for k, v in llama.items() if "expert" not in k}
    assert config_from_gguf_metadata(dense, {"token_embd.weight": (512, 64)}).architecture == "LlamaForCausalLM"
