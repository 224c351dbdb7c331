"""Mixture-of-experts GGUF files (qwen3moe, Mixtral as arch llama, gpt-oss incl. MXFP4 experts) written the way
llama.cpp's converter writes them (tests/hf_to_gguf.py) load to the same config and parameters as their Hugging Face
directories, through the same weight map; gpt-oss with non-square experts (intermediate 96, hidden 64) to the
tensors transformed by hand; and a parameter read in blocks de-quantizes one expert's (or block's) rows at a time."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from support.checkpoints import FIXTURES
from support.hf_to_gguf import to_gguf
from test_loader import CFG_FIELDS
from test_weight_map import (
    SMALL_BLOCK,
    assert_params_are,
    expected_params,
    write_mxfp4_gpt_oss,
    write_non_square_gpt_oss,
)

from netra_jax.loader import gguf_loader, load_model
from netra_jax.loader.gguf_config import config_from_gguf_metadata
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.models import weight_reads


def assert_same_model(gguf_path, hf_dir) -> None:
    cfg_g, p_g = load_model(gguf_path, "float32", cache=False)
    cfg_h, p_h = load_model(hf_dir, "float32", cache=False)
    assert {f: getattr(cfg_g, f) for f in CFG_FIELDS} == {f: getattr(cfg_h, f) for f in CFG_FIELDS}
    assert cfg_g.architecture == cfg_h.architecture
    assert jax.tree.structure(p_g) == jax.tree.structure(p_h)
    flat, _ = jax.tree_util.tree_flatten_with_path(p_g)
    for (path, a), b in zip(flat, jax.tree.leaves(p_h), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


VARIANTS = [  # fixture, layout of its expert tensors in the GGUF file
    ("tiny-qwen3-moe", "merged"),
    ("tiny-qwen3-moe", "fused"),
    ("tiny-mixtral", "merged"),
    ("tiny-mixtral", "per_expert"),
    ("tiny-gpt-oss", "merged"),
    ("tiny-gpt-oss", "fused"),
]


@pytest.mark.parametrize("name,variant", VARIANTS)
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


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
@pytest.mark.parametrize("fused", [False, True], ids=["merged", "fused"])
def test_non_square_gpt_oss_gguf(fused, mxfp4, tmp_path):
    """gpt-oss experts with hidden 64 != intermediate 96 through GGUF ([E, out, in] per projection, gate and up
    de-interleaved): every parameter equals the HF tensors transformed by hand."""
    cfg, tensors = write_non_square_gpt_oss(tmp_path / "hf")
    if mxfp4:
        cfg, tensors = write_mxfp4_gpt_oss(tmp_path / "mxfp4", tmp_path / "hf")
    src = tmp_path / ("mxfp4" if mxfp4 else "hf")
    path = to_gguf(src, tmp_path / "gpt-oss-96.gguf", fuse_gate_up=fused)
    shapes = {n: t.shape for n, t in GGUFFile(path).tensors.items()}  # llama.cpp's [E, out, in]
    gate_up = "blk.0.ffn_gate_up_exps.weight" if fused else "blk.0.ffn_gate_exps.weight"
    assert shapes[gate_up] == (4, 192 if fused else 96, 64) and shapes["blk.0.ffn_down_exps.weight"] == (4, 64, 96)
    cfg_g, params = load_model(path, "float32", cache=False)
    assert (cfg_g.hidden_size, cfg_g.moe_intermediate_size) == (64, 96)
    assert_params_are(params, expected_params(cfg, tensors), np.float32)


@pytest.mark.parametrize("name,variant", [*VARIANTS, ("gpt-oss-96-mxfp4", "merged"), ("gpt-oss-96-mxfp4", "fused")])
def test_moe_gguf_dequantizes_per_block(name, variant, tmp_path, monkeypatch):
    """With small read blocks, no expert tensor is de-quantized more than one expert at a time (by default a gpt-oss
    layer's experts go at once), Mixtral's llama-arch Q/K rows are un-permuted from partial heads, and the model
    still equals its HF directory (itself checked by hand in test_weight_map)."""
    src = FIXTURES / name
    if name == "gpt-oss-96-mxfp4":
        write_non_square_gpt_oss(tmp_path / "hf")
        src = tmp_path / "mxfp4"
        write_mxfp4_gpt_oss(src, tmp_path / "hf")
    path = to_gguf(
        src, tmp_path / "m.gguf", fuse_gate_up=variant == "fused", per_expert_tensors=variant == "per_expert"
    )
    gf = GGUFFile(path)
    sizes: list[tuple[str, int]] = []
    dequantize = gguf_loader.dequantize

    def spy(raw, qtype, shape, what="tensor"):
        out = dequantize(raw, qtype, shape, what)
        sizes.append((what.rsplit(" ", 1)[-1].strip("'"), out.size))
        return out

    monkeypatch.setattr(gguf_loader, "dequantize", spy)
    monkeypatch.setattr(weight_reads, "BLOCK_BYTES", SMALL_BLOCK)
    assert_same_model(path, src)
    one_expert = {n: int(np.prod(t.shape[1:])) for n, t in gf.tensors.items() if "_exps." in n and len(t.shape) == 3}
    expert_reads = [(n, size) for n, size in sizes if n in one_expert]
    assert all(size <= one_expert[n] for n, size in expert_reads)
    assert expert_reads or variant == "per_expert"  # old Mixtral files: one tensor per expert
    if name == "tiny-mixtral":  # wq [64 rows of 4 heads] read 11 rows at a time: from whole heads, not the tensor
        wq_size = int(np.prod(gf.tensors["blk.0.attn_q.weight"].shape))
        assert max(size for n, size in sizes if n.endswith("attn_q.weight")) < wq_size


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
