"""GGUF files written by llama.cpp's own converter (tests/fixtures/llamacpp-gguf, made from the fixture checkpoints by
tests/fixtures/make_llamacpp_gguf.py) checked against the ground truth, not against our GGUF writer: each loads to the
config and parameters of its Hugging Face directory and, through LLM, gives transformers' logits and greedy ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.checkpoints import DATA, FIXTURES, reference
from test_loader import CFG_FIELDS

from netra_jax import LLM, SamplingParams
from netra_jax.config import ModelConfig
from netra_jax.loader import load_model
from netra_jax.loader.gguf_loader import GGUFFile

LLAMACPP = DATA / "llamacpp-gguf"
MXFP4 = "tiny-gpt-oss-mxfp4"
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# file stem -> (general.architecture, a tensor showing the layout llama.cpp chose, its GGML type)
FILES = {
    "tiny-qwen3-moe": ("qwen3moe", "blk.0.ffn_gate_exps.weight", "F32"),
    "tiny-mixtral": ("llama", "blk.0.ffn_gate_exps.weight", "F32"),
    "tiny-gpt-oss": ("gpt-oss", "blk.0.attn_sinks.weight", "F32"),
    MXFP4: ("gpt-oss", "blk.0.ffn_gate_exps.weight", "MXFP4"),
    "tiny-llama": ("llama", "blk.0.attn_q.weight", "F32"),
    "tiny-qwen3": ("qwen3", "blk.0.attn_q_norm.weight", "F32"),
    "tiny-gemma3": ("gemma3", "blk.0.post_ffw_norm.weight", "F32"),
}


def gguf_path(name: str) -> Path:
    return LLAMACPP / f"{name}.gguf"


def hf_fixture(name: str) -> str:
    return "tiny-gpt-oss" if name == MXFP4 else name


@pytest.fixture(scope="module")
def mxfp4_hf_dir(tmp_path_factory) -> Path:
    """The HF checkpoint llama.cpp converted into tiny-gpt-oss-mxfp4.gguf: tiny-gpt-oss with its experts stored
    as MXFP4 blocks and scales (committed beside the file), as published gpt-oss checkpoints are."""
    d = tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")
    shutil.copytree(FIXTURES / "tiny-gpt-oss", d, dirs_exist_ok=True)
    experts = load_file(LLAMACPP / "gpt-oss-mxfp4.experts.safetensors")
    tensors = {k: v for k, v in load_file(d / "model.safetensors").items() if k + "_blocks" not in experts}
    save_file(tensors | experts, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "mxfp4"}}))
    return d


def reference_cases(name: str) -> list[dict]:
    """transformers' prompt ids, logits and greedy ids: the fixture's reference.json, or for the MXFP4 checkpoint
    the ones make_llamacpp_gguf.py computed with transformers."""
    if name != MXFP4:
        return reference(name)["cases"]
    ref = np.load(LLAMACPP / "gpt-oss-mxfp4.reference.npz")
    return [
        {
            "prompt_ids": ref[f"prompt_ids_{i}"].tolist(),
            "logits": ref[f"logits_{i}"],
            "greedy_ids": ref[f"greedy_ids_{i}"].tolist(),
        }
        for i in range(len(reference("tiny-gpt-oss")["cases"]))
    ]


def gemma3_llamacpp_layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """llama.cpp's converter writes no sliding-window pattern for Gemma 3 and its loader takes period 6 (layer i
    slides unless i % 6 == 5): tiny-gemma3's three layers (sliding, sliding, full) all slide in llama.cpp too."""
    return tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(cfg.num_layers))


@pytest.mark.parametrize("name", FILES)
def test_file_is_llamacpps(name):
    """The layout under test is the one llama.cpp wrote (architecture, tensor names, GGML type)."""
    arch, tensor, qtype = FILES[name]
    gf = GGUFFile(gguf_path(name))
    assert gf.architecture == arch
    assert gf.tensors[tensor].qtype.name == qtype


@pytest.mark.parametrize("name", FILES)
def test_loads_to_the_config_and_parameters_of_its_hf_directory(name, mxfp4_hf_dir):
    cfg_g, p_g = load_model(gguf_path(name), "float32", cache=False)
    cfg_h, p_h = load_model(mxfp4_hf_dir if name == MXFP4 else FIXTURES / name, "float32", cache=False)
    fields = [f for f in CFG_FIELDS if not (name == "tiny-gemma3" and f == "layer_types")]
    assert {f: getattr(cfg_g, f) for f in fields} == {f: getattr(cfg_h, f) for f in fields}
    assert cfg_g.architecture == cfg_h.architecture
    if name == "tiny-gemma3":
        assert cfg_g.layer_types == gemma3_llamacpp_layer_types(cfg_g) != cfg_h.layer_types
    assert jax.tree.structure(p_g) == jax.tree.structure(p_h)
    flat, _ = jax.tree_util.tree_flatten_with_path(p_g)
    for (path, a), b in zip(flat, jax.tree.leaves(p_h), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# tiny-gemma3 is left out: its third layer is a full-attention one, which llama.cpp's file does not record, so
# llama.cpp (and this runtime, reading the file as llama.cpp does) runs it with the sliding window and the local
# RoPE base, and transformers' logits for the checkpoint are not the file's
LLM_FILES = [name for name in FILES if name != "tiny-gemma3"]


@pytest.fixture(scope="module", params=LLM_FILES)
def llamacpp_llm(request):
    llm = LLM(gguf_path(request.param), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    return request.param, llm


def test_logits_match_transformers(llamacpp_llm):
    name, llm = llamacpp_llm
    for case in reference_cases(name):
        want = np.asarray(case["logits"], np.float32)
        np.testing.assert_allclose(llm.logits(case["prompt_ids"]), want, rtol=0, atol=1e-4)


def test_greedy_matches_transformers(llamacpp_llm):
    name, llm = llamacpp_llm
    for case in reference_cases(name):
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == case["greedy_ids"]


def test_tokenizer_and_chat_template_from_llamacpp_metadata(llamacpp_llm):
    """llama.cpp's vocabulary, merges, special tokens and chat template give the reference chat prompt's ids."""
    name, llm = llamacpp_llm
    chat = reference(hf_fixture(name))["chat"]
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["prompt_text"]
    assert tok.encode(chat["prompt_text"]) == chat["prompt_ids"]
    assert tok.decode(chat["prompt_ids"], skip_special_tokens=False) == chat["prompt_text"]
