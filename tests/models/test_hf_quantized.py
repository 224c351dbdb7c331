"""Hugging Face quantized checkpoints read as stored (`loader.hf_quant`), against the fixtures the formats' own
libraries packed (tests/fixtures/make_quantized.py): our de-quantized weights equal the library's, the logits equal
transformers' on the library's de-quantized weights within the rounding the format implies, the served greedy tokens
equal transformers', and every refused option or malformed tensor fails in one line naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.checkpoints import DATA
from support.checkpoints import FIXTURES as SHARED_FIXTURES
from test_ggml_weights import _PEAK as PEAK

from netra_jax import LLM, SamplingParams
from netra_jax.config import ConfigError
from netra_jax.loader import CheckpointError, load_model
from netra_jax.models.transformer import forward_dense
from netra_jax.models.weight_reads import WeightError
from netra_jax.quant import BlockFP8Weight, PackedIntWeight, QuantizedWeight, is_quantized, matmul

FIXTURES = DATA / "quantized"
# format -> (the weight type its projections load as, logit tolerance relative to the largest logit). The integer
# formats de-quantize to exactly the library's fp16 / bf16 values (float32 arithmetic differences only); the fp8 ones
# keep the float32 product q * scale, which the libraries round to bf16 (2^-9 relative per weight).
FORMATS = {
    "fp8_block": (BlockFP8Weight, 1e-2),
    "fp8_tensor": (QuantizedWeight, 1e-2),
    "ct_fp8_channel": (QuantizedWeight, 1e-2),
    "ct_w4a16": (PackedIntWeight, 1e-5),
    "ct_w4a16_asym": (PackedIntWeight, 1e-5),
    "awq": (PackedIntWeight, 1e-5),
    "gptq": (PackedIntWeight, 1e-5),
}
OURS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "down_proj": "w_down"}


def reference(fmt: str) -> dict[str, np.ndarray]:
    return load_file(FIXTURES / f"{fmt}.reference.safetensors")


def dequantized(w) -> np.ndarray:
    """A quantized weight de-quantized under jit, as the served steps do it (XLA may fuse away a rounding)."""
    return np.asarray(jax.jit(lambda w: w.dequantize())(w) if is_quantized(w) else w)


def our_weight(params: dict, module: str) -> np.ndarray:
    """Our de-quantized parameter for a HF module name, as the torch Linear's [out, in]."""
    if module == "lm_head":
        return dequantized(params["lm_head"]).T
    *_, proj = module.split(".")
    lp = params["layers"][int(module.split(".")[2])]
    if proj in OURS:
        return dequantized(lp[OURS[proj]]).T
    return dequantized(lp["w_gate_up"])[:, 0 if proj == "gate_proj" else 1, :].T  # [hidden, 2, I]


@pytest.fixture(scope="module", params=list(FORMATS))
def loaded(request):
    fmt = request.param
    cfg, params = load_model(FIXTURES / fmt, dtype="float32", cache=False)
    return fmt, cfg, params


def test_dequantized_weights_equal_the_librarys(loaded):
    """Integer formats: exactly the library's fp16 / bf16 values. fp8: our float32 q * scale rounded to the
    library's output dtype is its value exactly (the libraries round the product once to the model dtype)."""
    fmt, _, params = loaded
    ref = reference(fmt)
    modules = [k.removesuffix(".weight") for k in ref if k.endswith(".weight")]
    assert len(modules) >= 5
    for module in modules:
        want = ref[f"{module}.weight"]
        got = our_weight(params, module)
        assert got.shape == want.shape, module
        np.testing.assert_array_equal(got.astype(want.dtype), want, err_msg=f"{fmt} {module}")
        if FORMATS[fmt][0] is PackedIntWeight:
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=f"{fmt} {module}")


def test_projections_stay_quantized(loaded):
    """What the library quantized stays quantized (fp8 blocks of 128 x 128 where the weight has several tiles, else
    one per-tensor scale); what it left in float is a float array."""
    fmt, _, params = loaded
    quantized = {k.removesuffix(".weight").split(".")[-1] for k in reference(fmt) if k.endswith(".weight")}
    lp = params["layers"][0]
    for proj, name in {**OURS, "gate_proj": "w_gate_up"}.items():
        assert is_quantized(lp[name]) == (proj in quantized), (fmt, name)
    assert is_quantized(params["lm_head"]) == ("lm_head" in quantized)
    kind = FORMATS[fmt][0]
    assert isinstance(lp["w_gate_up"], kind) and isinstance(lp["w_down"], kind)


def test_logits_match_transformers_on_the_dequantized_weights(loaded):
    fmt, cfg, params = loaded
    ref = reference(fmt)
    logits = np.asarray(forward_dense(params, cfg, jnp.asarray(ref["prompt_ids"])))  # [prompt, vocab]
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=FORMATS[fmt][1] * scale)


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_w4a16_asym", "gptq"])
def test_served_greedy_tokens_equal_transformers(fmt):
    ref = reference(fmt)
    llm = LLM(str(FIXTURES / fmt), dtype="float32", max_model_len=64, warmup=False)
    out = llm.generate(
        [{"prompt_token_ids": ref["prompt_ids"].tolist()}],
        SamplingParams(max_tokens=len(ref["greedy_ids"]), temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert list(out[0].outputs[0].token_ids) == ref["greedy_ids"].tolist()


def test_fused_act_order_weights_equal_their_parts():
    """gate and up fused along their outputs: the act-order g_idx they share and each part's scales and zero points
    move with their columns, so one matmul of the fused weight equals the library's two weights."""
    _, params = load_model(FIXTURES / "gptq", dtype="float32", cache=False)
    w = params["layers"][0]["w_gate_up"]
    assert w.g_idx is not None and w.zero is not None and w.shape[1] == 2
    ref = reference("gptq")
    parts = [ref[f"model.layers.0.mlp.{p}_proj.weight"].astype(np.float64).T for p in ("gate", "up")]  # [K, I]
    x = np.random.default_rng(0).standard_normal((3, w.shape[0])).astype(np.float32)
    y = np.asarray(matmul(jnp.asarray(x), w, "th,hki->tki"))
    np.testing.assert_allclose(y, np.einsum("th,hki->tki", x, np.stack(parts, axis=1)), rtol=1e-5, atol=1e-5)


def _copy(fmt: str, tmp_path: Path, qc_update: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of a fixture with its quantization_config updated and tensors replaced (by a second shard read after
    model.safetensors: numpy cannot rewrite the fp8 tensors)."""
    d = tmp_path / fmt
    shutil.copytree(FIXTURES / fmt, d)
    if qc_update is not None:
        c = json.loads((d / "config.json").read_text())
        c["quantization_config"] |= qc_update
        (d / "config.json").write_text(json.dumps(c))
    if tensors:
        save_file(tensors, d / "zz-override.safetensors")
    return d


@pytest.mark.parametrize(
    "fmt,update,match",
    [
        ("gptq", {"bits": 3}, "GPTQ bits 3 are not supported"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("awq", {"version": "gemv"}, "AWQ version 'gemv'"),
        ("awq", {"desc_act": True}, "desc_act .* not part of the AWQ format"),
        ("fp8_block", {"fmt": "e5m2"}, "fmt 'e5m2'"),
        ("ct_w4a16", {"format": "marlin-24"}, "format 'marlin-24'"),
        ("ct_w4a16", {"quant_method": "quark"}, "quant_method 'quark' is not supported"),
    ],
)
def test_an_unread_option_fails_in_one_line(tmp_path, fmt, update, match):
    d = _copy(fmt, tmp_path, update)
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(d, cache=False)
    assert "\n" not in str(e.value)


def test_tensors_of_the_wrong_shape_fail_in_one_line(tmp_path):
    ref = load_file(FIXTURES / "gptq" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj."
    cases = [
        ({q + "scales": ref[q + "scales"][:2]}, r"tensor '.*q_proj.scales' has shape \(2, 128\), expected \(4, 128\)"),
        ({q + "qweight": ref[q + "qweight"][:8]}, r"tensor '.*q_proj.qweight' \(read as .*\) has shape \(128, 64\)"),
    ]
    for i, (tensors, match) in enumerate(cases):
        d = _copy("gptq", tmp_path / str(i), tensors=tensors)
        with pytest.raises(WeightError, match=match) as e:
            load_model(d, cache=False)
        assert "\n" not in str(e.value)


def test_block_scales_of_the_wrong_shape_fail(tmp_path):
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    d = _copy("fp8_block", tmp_path, tensors={name: np.ones((1, 1, 2), np.float32)})
    with pytest.raises(WeightError, match="gate_proj.weight_scale_inv' has shape"):
        load_model(d, cache=False)


def test_quantization_on_top_of_a_quantized_checkpoint_is_refused():
    """As vLLM: a method other than the checkpoint's own is an error; its own method changes nothing."""
    with pytest.raises(ConfigError, match="quantized by gptq.*quantization='int8' differs") as e:
        LLM(str(FIXTURES / "gptq"), quantization="int8", warmup=False)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="not de-quantized"):
        load_model(FIXTURES / "awq", keep_quantized=False, cache=False)


def test_fp8_on_an_fp8_checkpoint_keeps_its_scales_and_float_modules():
    llm = LLM(str(FIXTURES / "fp8_block"), dtype="float32", quantization="fp8", max_model_len=64, warmup=False)
    lp = llm.params["layers"][0]
    assert isinstance(lp["w_gate_up"], BlockFP8Weight) and not is_quantized(lp["wk"])  # k_proj: left float


def test_an_ignored_module_stored_quantized_is_refused(tmp_path):
    d = _copy("ct_w4a16", tmp_path, {"ignore": ["lm_head", "re:.*down_proj"]})
    with pytest.raises(WeightError, match="down_proj' is in the quantization ignore list but stored quantized"):
        load_model(d, cache=False)


def write_random_gptq(
    d: Path, hidden: int = 1024, layers: int = 4, inter: int = 4096, bits: int = 4, group: int = 128, fmt="gptq_v2"
) -> Path:
    """A Llama-shaped GPTQ checkpoint (`bits`, `group`, checkpoint_format `fmt`) of random words and scales, written
    with numpy."""
    rng = np.random.default_rng(0)
    d.mkdir()
    cfg = json.loads((FIXTURES / "gptq" / "config.json").read_text())
    cfg |= {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8}
    cfg |= {"num_key_value_heads": 4, "head_dim": hidden // 8}
    cfg["quantization_config"] |= {"bits": bits, "group_size": group, "desc_act": False, "checkpoint_format": fmt}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "gptq" / f, d / f)
    kv, per = hidden // 2, 32 // bits
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv)}
    shapes |= {"self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter)}
    shapes |= {"mlp.down_proj": (inter, hidden)}  # [K, N]
    tensors = {"model.embed_tokens.weight": rng.standard_normal((512, hidden)).astype(np.float16)}
    tensors["model.norm.weight"] = np.ones(hidden, np.float16)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(hidden, np.float16)}
        tensors |= {p + "post_attention_layernorm.weight": np.ones(hidden, np.float16)}
        for proj, (k, n) in shapes.items():
            m, size = p + proj + ".", k if group == -1 else group
            tensors[m + "qweight"] = rng.integers(-(2**31), 2**31, size=(k // per, n), dtype=np.int32)
            tensors[m + "qzeros"] = rng.integers(-(2**31), 2**31, size=(k // size, n // per), dtype=np.int32)
            tensors[m + "scales"] = rng.uniform(0.001, 0.01, size=(k // size, n)).astype(np.float16)
            tensors[m + "g_idx"] = (np.arange(k) // size).astype(np.int32)
    save_file(tensors, d / "model.safetensors")
    return d


@pytest.mark.parametrize("bits,group,fmt", [(8, -1, "gptq"), (8, 64, "gptq_v2"), (4, -1, "gptq")])
def test_gptq_bit_widths_and_groups_follow_the_format(tmp_path, bits, group, fmt):
    """8-bit and per-channel (group -1) GPTQ, v1 and v2 zero points, against numpy's reading of the stored words:
    value j of a word at bits [bits * j, bits * (j + 1)), w = (q - z) * scale in fp16, z stored minus 1 in v1."""
    d = write_random_gptq(tmp_path / "g", hidden=128, layers=1, inter=256, bits=bits, group=group, fmt=fmt)
    _, params = load_model(d, dtype="float32", cache=False)
    raw = load_file(d / "model.safetensors")
    m, per, mask = "model.layers.0.mlp.down_proj.", 32 // bits, (1 << bits) - 1
    words, zeros = raw[m + "qweight"].view(np.uint32), raw[m + "qzeros"].view(np.uint32)
    k, n = words.shape[0] * per, words.shape[1]
    q = np.empty((k, n), np.int64)
    z = np.empty((zeros.shape[0], n), np.int64)
    for j in range(per):
        q[j::per] = (words >> (bits * j)) & mask
        z[:, j::per] = (zeros >> (bits * j)) & mask
    z += 1 if fmt == "gptq" else 0
    g = np.arange(k) // (k if group == -1 else group)
    want = ((q - z[g]).astype(np.float16) * raw[m + "scales"][g]).astype(np.float32)  # numpy rounds fp16 once
    np.testing.assert_array_equal(dequantized(params["layers"][0]["w_down"]), want)


def test_a_quantized_load_holds_about_the_quantized_bytes_once(tmp_path):
    """Peak RSS of the load over the runtime's baseline within 1.5x the file (a 34 MB GPTQ checkpoint; 1.27x measured):
    tensors are read one at a time from the memory map, never as a float copy of the model (float32 would be 8x)."""
    d = write_random_gptq(tmp_path / "gptq")
    size = (d / "model.safetensors").stat().st_size
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PEAK, str(d)], capture_output=True, text=True, env=env, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["held"] <= 1.1 * size  # the packed words and fp16 scales as stored (the embedding widened to float32)
    assert m["peak"] - m["base"] <= 1.5 * size, (m, size)


def test_quantized_moe_experts_are_refused_naming_the_tensor(tmp_path):
    src = SHARED_FIXTURES / "tiny-qwen3-moe"
    d = tmp_path / "moe"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True, "desc_act": False}
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    expert = "model.layers.0.mlp.experts.0.gate_proj."
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    tensors = {expert + "qweight": np.zeros((hidden // 8, inter), np.int32)}
    save_file(tensors | {expert + "scales": np.ones((1, inter), np.float16)}, d / "zz-quantized.safetensors")
    with pytest.raises(WeightError, match=r"experts.0.gate_proj.qweight' \(gptq .*quantized MoE experts") as e:
        load_model(d, cache=False)
    assert "\n" not in str(e.value)
