"""GPT-2, GPT-NeoX (Pythia) and Gemma 2 against transformers: per-position logits and greedy tokens of the tiny
fixtures (tests/fixtures/make_tiny_families.py) through the pure forward and the engine, their configs' flags (also
from published config layouts), and the loaders' layouts: fused q/k/v split per device, the dummy loader's pytree, a
GPT-2 checkpoint saved without its `transformer.` prefix."""

from __future__ import annotations

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import DATA
from support.workers import run_device_worker

from netra_jax import LLM, SamplingParams, parallel
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.loader import load_model
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.transformer import forward_dense, fuse_qkv
from netra_jax.models.weight_map import WeightError, hf_to_params
from netra_jax.ops import cpu_decode_layer, cpu_kernels
from netra_jax.quant import QuantizedWeight

FAMILIES = ["tiny-gpt2", "tiny-pythia", "tiny-gemma2"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ATOL = 1e-4  # float32 logits, as the shared fixtures' README asks


def reference(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(reference.json: cases with prompt_ids and greedy_ids, the chat case; reference.npz: logits_{case})."""
    npz = np.load(DATA / name / "reference.npz")
    return json.loads((DATA / name / "reference.json").read_text()), {k: npz[k] for k in npz.files}


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request):
    llm = LLM(DATA / request.param, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    return request.param, llm


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_logits_match_transformers(name):
    """Every position of the longest prompt (past Gemma 2's sliding window), unfused and with q/k/v joined (the CPU
    engine's layout); the engine tests below run every prompt."""
    cfg, params = load_model(DATA / name, "float32", cache=False)
    ref, logits = reference(name)
    fused = fuse_qkv(params)
    for lp, fp in zip(params["layers"], fused["layers"], strict=True):
        assert "wqkv" in fp and ("bqkv" in fp) == ("bq" in lp)
    ids = jnp.asarray(ref["cases"][2]["prompt_ids"], jnp.int32)
    for p in (params, fused):
        got = np.asarray(forward_dense(p, cfg, ids))
        assert got.shape == logits["logits_2"].shape
        assert np.abs(got - logits["logits_2"]).max() < ATOL, name


def test_engine_logits_match_transformers(engine):
    name, llm = engine
    ref, logits = reference(name)
    for i, case in enumerate(ref["cases"]):
        assert np.abs(llm.logits(case["prompt_ids"]) - logits[f"logits_{i}"]).max() < ATOL, (name, i)


def test_engine_greedy_matches_transformers(engine):
    """One prompt at a time, then all together (decode steps batching sequences of different lengths)."""
    name, llm = engine
    cases = reference(name)[0]["cases"]
    for case in cases:
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == case["greedy_ids"], name
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]


def test_chat_template_renders_reference(engine):
    name, llm = engine
    chat = reference(name)[0]["chat"]
    out = llm.chat(chat["messages"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt == chat["prompt_text"]
    assert out.prompt_token_ids == chat["prompt_ids"]


def test_config_flags():
    gpt2, neox, gemma2 = (ModelConfig.from_hf_dir(DATA / n) for n in FAMILIES)
    assert (gpt2.norm_kind, gpt2.position_embedding, gpt2.gated_mlp, gpt2.hidden_act) == (
        "layernorm",
        "learned",
        False,
        "gelu_tanh",
    )
    assert gpt2.tie_word_embeddings and not gpt2.parallel_residual and gpt2.rms_norm_eps == 1e-5
    assert (neox.norm_kind, neox.position_embedding, neox.gated_mlp, neox.hidden_act) == (
        "layernorm",
        "rope",
        False,
        "gelu",
    )
    assert neox.parallel_residual and neox.rotary_dim == neox.head_dim // 4 and not neox.tie_word_embeddings
    assert (gemma2.norm_kind, gemma2.gated_mlp, gemma2.qk_norm) == ("rmsnorm", True, False)
    assert gemma2.sandwich_norms and gemma2.norm_weight_offset and gemma2.scale_embeddings
    assert gemma2.layer_types == ("sliding_attention", "full_attention") and gemma2.sliding_window == 16
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (8.0, 5.0)
    assert gemma2.attn_scale == pytest.approx(24**-0.5) and gemma2.rope_sliding == gemma2.rope_full
    with pytest.raises(ConfigError, match="norm kind"):
        gpt2.replace(norm_kind="batchnorm")


def test_published_config_layouts():
    """The config.json fields of published checkpoints: GPT-2's n_* names and null n_inner, Pythia's rotary_pct and
    rotary_emb_base, Gemma 2 without layer_types (even layers slide) and with a top-level rope_theta."""
    gpt2 = ModelConfig.from_hf_dict(
        {
            "architectures": ["GPT2LMHeadModel"],
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "n_positions": 1024,
            "n_ctx": 1024,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "vocab_size": 50257,
        }
    )
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings, gpt2.head_dim) == (3072, 1024, 64)
    assert gpt2.tie_word_embeddings and gpt2.hidden_act == "gelu_tanh" and gpt2.attn_scale == 64**-0.5
    pythia = ModelConfig.from_hf_dict(
        {
            "architectures": ["GPTNeoXForCausalLM"],
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_attention_heads": 8,
            "num_hidden_layers": 6,
            "rotary_emb_base": 10000,
            "rotary_pct": 0.25,
            "use_parallel_residual": True,
            "layer_norm_eps": 1e-5,
            "hidden_act": "gelu",
            "vocab_size": 50304,
            "max_position_embeddings": 2048,
        }
    )
    assert pythia.rotary_dim == 16 and pythia.rope_full.theta == 10000.0 and pythia.parallel_residual
    sequential = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "intermediate_size": 256}
    sequential |= {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 512, "use_parallel_residual": False}
    neox = ModelConfig.from_hf_dict(sequential)
    assert not neox.parallel_residual and neox.rotary_dim == 4  # GPTNeoXConfig's default rotary_pct 0.25
    gemma2 = json.loads((DATA / "tiny-gemma2" / "config.json").read_text())
    del gemma2["layer_types"], gemma2["rope_parameters"]
    cfg = ModelConfig.from_hf_dict(gemma2 | {"num_hidden_layers": 4, "rope_theta": 5000.0})
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.rope_full.theta == cfg.rope_sliding.theta == 5000.0
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_dict({**json.loads((DATA / "tiny-gpt2" / "config.json").read_text()), key: True})


def test_cpu_decode_layer_takes_only_its_own_layer():
    """The one-call CPU layer implements the sequential RMSNorm / gated-MLP / RoPE layer: Gemma 2's layers take it,
    a layer differing in any of those flags runs the jnp layer."""
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built")
    cfg, params = load_model(DATA / "tiny-gemma2", "float32", cache=False)
    lp = fuse_qkv(params)["layers"][0]
    pages = jnp.zeros((4, 16, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    assert cpu_decode_layer.takes(lp, cfg, 0, pages, 1)
    for change in ({"norm_kind": "layernorm"}, {"parallel_residual": True}, {"position_embedding": "learned"}):
        assert not cpu_decode_layer.takes(lp, cfg.replace(**change), 0, pages, 1), change
    for name in ("tiny-gpt2", "tiny-pythia"):
        cfg, params = load_model(DATA / name, "float32", cache=False)
        lp = fuse_qkv(params)["layers"][0]
        assert not cpu_decode_layer.takes(lp, cfg, 0, pages, 1)


@pytest.mark.parametrize("name,tp", [("tiny-gpt2", 2), ("tiny-pythia", 4), ("tiny-gemma2", 2)])
def test_fused_qkv_slices_per_device(name, tp):
    """Each device's slice of every parameter, read from the memory map (q, k and v columns picked out of the fused
    tensor, GPT-NeoX's per head), equals that slice of the whole conversion."""
    cfg = ModelConfig.from_hf_dir(DATA / name)
    ck = HFCheckpoint(DATA / name)
    full = hf_to_params(cfg, ck.get, ck.has, np.float32)
    reader, leaves = parallel.sharded_leaves(ck.get, ck.has, cfg, np.float32, tp)
    is_leaf = lambda x: isinstance(x, parallel.Leaf)  # noqa: E731
    flat_l, tree = jax.tree.flatten(leaves, is_leaf=is_leaf)
    specs = tree.flatten_up_to(parallel.param_specs(leaves, cfg, tp))
    for leaf, want, spec in zip(flat_l, tree.flatten_up_to(full), specs, strict=True):
        axis = next((i for i, s in enumerate(spec) if s == parallel.TP), None)
        for d in range(tp if axis is not None else 1):
            idx = [slice(0, n) for n in want.shape]
            if axis is not None:
                n = want.shape[axis] // tp
                idx[axis] = slice(d * n, (d + 1) * n)
            np.testing.assert_array_equal(leaf.read(tuple(idx)), want[tuple(idx)])


@pytest.mark.parametrize("name", FAMILIES)
def test_dummy_loader_has_the_real_layout(name):
    _, real = load_model(DATA / name, "float32", cache=False)
    _, fake = load_model(DATA / name, "float32", load_format="dummy")
    layout = lambda t: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), t)  # noqa: E731
    assert layout(fake) == layout(real)


def test_gpt2_saved_without_its_prefix(tmp_path):
    """Published GPT-2 checkpoints name their tensors as the bare GPT2Model does (`wte.weight`, `h.0.attn...`)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(DATA / "tiny-gpt2", tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    assert not any(k.startswith("transformer.") for k in load_file(tmp_path / "model.safetensors"))
    cfg, params = load_model(tmp_path, "float32", cache=False)
    ref, logits = reference("tiny-gpt2")
    got = np.asarray(forward_dense(params, cfg, jnp.asarray(ref["cases"][1]["prompt_ids"])))
    assert np.abs(got - logits["logits_1"]).max() < ATOL


def test_missing_layernorm_bias_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(DATA / "tiny-pythia", tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["gpt_neox.layers.1.post_attention_layernorm.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"gpt_neox\.layers\.1\.post_attention_layernorm\.bias"):
        load_model(tmp_path, "float32", cache=False)


def test_int8_and_lora_enabled_engines_serve_gpt2():
    """Online int8 quantizes the q/k/v, output, up and down projections (the ungated w_up too); an engine with LoRA
    slots (all zero here) gives the base model's greedy tokens."""
    ref, logits = reference("tiny-gpt2")
    case = ref["cases"][0]
    q = LLM(DATA / "tiny-gpt2", dtype="float32", quantization="int8", warmup=False, max_num_seqs=2)
    lp = q.engine.runner.params["layers"][0]
    assert all(isinstance(lp[k], QuantizedWeight) for k in ("wq", "wk", "wv", "wo", "w_up", "w_down"))
    assert np.abs(q.logits(case["prompt_ids"]) - logits["logits_0"]).max() < 0.05 * np.abs(logits["logits_0"]).max()
    lora = LLM(DATA / "tiny-gpt2", dtype="float32", enable_lora=True, warmup=False, max_num_seqs=2)
    out = lora.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == case["greedy_ids"]


# ------------------------------------------------------------------------------- tensor parallel, 2 fake CPU devices
def test_tensor_parallel_matches_transformers(tmp_path):
    """Each family split two ways (q/k/v columns, w_up and b_up split, w_down row-split with b_down added once,
    pos_embed and norm biases replicated): the reference's logits and greedy tokens."""
    results = run_device_worker(__file__, tmp_path / "results.json", devices=2)
    for name in FAMILIES:
        ref, logits = reference(name)
        assert np.abs(np.asarray(results[name]["logits"]) - logits["logits_2"]).max() < ATOL, name
        assert results[name]["greedy"] == ref["cases"][2]["greedy_ids"], name


def _worker(out_path: str) -> None:
    assert len(jax.devices()) == 2
    results = {}
    for name in FAMILIES:
        case = reference(name)[0]["cases"][2]
        llm = LLM(DATA / name, dtype="float32", tensor_parallel_size=2, max_num_seqs=2, num_kv_pages=16, warmup=False)
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
        results[name] = {"logits": llm.logits(case["prompt_ids"]).tolist(), "greedy": out.outputs[0].token_ids}
    with open(out_path, "w") as f:
        json.dump(results, f)


# ------------------------------------------------------------------------------- GGUF files of llama.cpp's converter
GGUF = DATA / "llamacpp-gguf-families"


def _as_numpy(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_loads_the_hf_parameters(name):
    """llama.cpp's file of each fixture gives the Hugging Face load's parameters (GPT-2's Conv1D weights transposed
    back, GPT-NeoX's q/k/v re-interleaved per head, Gemma's 1 + w norms undone) and config; Gemma 2's files carry no
    query scale, llama.cpp's 1/sqrt(head_dim) is read instead of the checkpoint's query_pre_attn_scalar."""
    cfg_g, from_gguf = load_model(GGUF / f"{name}.gguf", "float32", cache=False)
    cfg_h, from_hf = load_model(DATA / name, "float32", cache=False)
    assert jax.tree.structure(from_gguf) == jax.tree.structure(from_hf)
    for a, b in zip(_as_numpy(from_gguf), _as_numpy(from_hf), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # norms: (w + 1) - 1 in float32
    expected = cfg_h.replace(attn_scale=cfg_h.head_dim**-0.5) if name == "tiny-gemma2" else cfg_h
    assert cfg_g.replace(architecture=cfg_h.architecture) == expected


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-pythia"])
def test_gguf_engine_matches_transformers(name):
    """Through the engine, with the file's own tokenizer: the reference's logits and greedy tokens."""
    llm = LLM(GGUF / f"{name}.gguf", dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, warmup=False)
    ref, logits = reference(name)
    case = ref["cases"][0]
    assert llm.get_tokenizer().encode(case["text"]) == case["prompt_ids"]
    assert np.abs(llm.logits(case["prompt_ids"]) - logits["logits_0"]).max() < ATOL
    out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == case["greedy_ids"]


def test_gguf_q8_0_keeps_the_linear_weights_in_blocks(tmp_path):
    """A Q8_0 GPT-NeoX file: the output, ungated up and down projections stay in their blocks, the fused q/k/v
    (split into wq, wk, wv) is de-quantized; the logits stay near the float model's."""
    from support.hf_to_gguf import requantized

    from netra_jax.quant import GGMLWeight

    path = requantized(GGUF / "tiny-pythia.gguf", tmp_path / "q8.gguf", "Q8_0")
    cfg, params = load_model(path, "float32", cache=False)
    lp = params["layers"][0]
    assert all(isinstance(lp[k], GGMLWeight) for k in ("wo", "w_up", "w_down"))
    assert all(isinstance(lp[k], jax.Array) for k in ("wq", "wk", "wv"))
    ref, logits = reference("tiny-pythia")
    got = np.asarray(forward_dense(params, cfg, jnp.asarray(ref["cases"][1]["prompt_ids"])))
    assert np.abs(got - logits["logits_1"]).max() < 0.05 * np.abs(logits["logits_1"]).max()


if __name__ == "__main__":
    _worker(sys.argv[1])
