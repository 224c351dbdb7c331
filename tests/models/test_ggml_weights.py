"""GGUF tensors kept in their GGML blocks (`netra_jax.quant.GGMLWeight`, `ops.ggml_blocks`): the jnp de-quantization
of every kept type equals the values hand-encoded blocks stand for; the matmul, its einsum form and the embedding's
row gather equal float arithmetic on those values; a GGUF file loads with its weights kept (a tied lm_head sharing the
embedding's buffer, nothing written to the parameter cache, about the file's bytes of memory) and the engine's greedy
tokens equal the de-quantized model's, on XLA and on the CPU kernels. Q4_K and Q6_K rows interleaved by 16 (the
"cpu_rows_q8" layout) hold the same values, made where that backend runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from support.checkpoints import FIXTURES
from support.compiles import compiled_jits
from support.gguf_blocks import ENCODERS, int8_rounded
from support.hf_to_gguf import requantized

from benchmarks import random_gguf
from netra_jax import LLM, SamplingParams
from netra_jax.loader import CheckpointError, gguf_names, load_model
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.models import weight_map
from netra_jax.models.transformer import forward_dense
from netra_jax.ops import cpu_ggml_matmul, cpu_kernels
from netra_jax.ops.ggml_blocks import (
    FORMATS,
    GGUF_TYPES,
    deinterleave_rows,
    dequantize_rows,
    interleave_rows,
    row_bytes,
)
from netra_jax.quant import GGMLWeight, embedding_rows, matmul, weight_layout

REPO = Path(__file__).resolve().parents[2]


def encoded(qtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [rows, row_bytes], float32 [rows, cols]) from test_gguf_quants' hand encoders."""
    blocks, ref = ENCODERS[Q[qtype]](rows, cols)
    return blocks.reshape(rows, -1).astype(np.uint8), np.asarray(ref, np.float32).reshape(rows, cols)


@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_dequantize_rows_equals_hand_encoded_blocks(qtype):
    qk = FORMATS[qtype].qk
    for rows, cols in ((1, qk), (3, 3 * qk), (7, 1024)):
        data, ref = encoded(qtype, rows, cols)
        assert data.shape == (rows, row_bytes(qtype, cols))
        got = np.asarray(dequantize_rows(jnp.asarray(data), qtype))
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=f"{qtype} {rows}x{cols}")


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="multiples of 18 bytes"):
        dequantize_rows(jnp.zeros((2, 20), jnp.uint8), "Q4_0")
    with pytest.raises(ValueError, match="multiples of 256"):
        row_bytes("Q4_K", 300)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_interleaved_rows_are_the_same_values(qtype):
    data, w = encoded(qtype, 48, 768)  # [48, 3 blocks]
    x16, name = interleave_rows(jnp.asarray(data), qtype)
    assert name == f"{qtype}_X16" and x16.shape == data.shape and x16.dtype == jnp.uint8
    if qtype == "Q4_K":  # the same nibbles, moved (Q6_K's high 2-bit parts are packed anew)
        nibbles = lambda b: np.sort(np.concatenate([b.ravel() & 15, b.ravel() >> 4]))  # noqa: E731
        np.testing.assert_array_equal(nibbles(np.asarray(x16)), nibbles(data))
    np.testing.assert_array_equal(np.asarray(deinterleave_rows(x16, name)), data)
    np.testing.assert_array_equal(np.asarray(dequantize_rows(x16, name)), np.asarray(dequantize_rows(data, qtype)))
    np.testing.assert_allclose(np.asarray(dequantize_rows(x16, name)), w, rtol=1e-6, atol=1e-7)
    stacked, _ = interleave_rows(jnp.asarray(data).reshape(3, 16, -1), qtype)  # groups along the last output axis
    np.testing.assert_array_equal(np.asarray(deinterleave_rows(stacked, name)).reshape(48, -1), data)
    # row 17 sits in group 1 beside rows 16..31: bytes 2-3 of the group's block 0 are row 1's d
    d_at = 0 if qtype == "Q4_K" else 208
    np.testing.assert_array_equal(np.asarray(x16).reshape(3, 3, -1)[1, 0, 2:4], data[17, d_at : d_at + 2])
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_rows(jnp.asarray(data[:40]), qtype)
    with pytest.raises(ValueError, match="no interleaved layout of Q4_0"):
        interleave_rows(jnp.zeros((16, 18), jnp.uint8), "Q4_0")


@pytest.mark.skipif(cpu_kernels.interleaved_rows() != 16, reason="this build reads no interleaved layout")
def test_cpu_rows_q8_layout_interleaves_q4_k_and_q6_k_matmul_weights_only():
    data, w = encoded("Q4_K", 64, 256)
    q6, _ = encoded("Q6_K", 32, 256)
    q8, _ = encoded("Q8_0", 32, 256)
    table = GGMLWeight(jnp.asarray(data), "Q4_K", transposed=False)
    params = {
        "gate_up": GGMLWeight(jnp.asarray(data).reshape(2, 32, -1), "Q4_K"),  # [2, 32, row_bytes]
        "odd": GGMLWeight(jnp.asarray(data[:40]), "Q4_K"),  # 40 rows: not whole groups
        "q6": GGMLWeight(jnp.asarray(q6), "Q6_K"),
        "q8": GGMLWeight(jnp.asarray(q8), "Q8_0"),  # no interleaved layout
        "experts": GGMLWeight(jnp.asarray(data).reshape(2, 32, -1), "Q4_K", batch_dims=1),  # per expert: as stored
        "embed": table,
        "lm_head": table.replace(transposed=True),  # tied: shares the table's blocks
    }
    laid = weight_layout(params, "cpu_rows_q8")
    assert laid["gate_up"].qtype == "Q4_K_X16" and laid["gate_up"].data.shape == (2, 32, 144)
    assert laid["q6"].qtype == "Q6_K_X16"
    kept = ("odd", "q8", "experts", "embed", "lm_head")
    assert [laid[n].qtype for n in kept] == ["Q4_K", "Q8_0", "Q4_K", "Q4_K", "Q4_K"]
    assert laid["lm_head"].data is table.data
    assert weight_layout(laid, "cpu_rows_q8")["gate_up"].data is laid["gate_up"].data  # once laid, as it is
    assert weight_layout(params, "cpu_rows")["gate_up"].qtype == "Q4_K"  # float activations read Q4_K as stored
    x = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)
    want = int8_rounded(x, "Q4_K") @ w.T.astype(np.float64)  # [3, 64]
    got = matmul(jnp.asarray(x), laid["gate_up"], "th,hki->tki", backend="cpu_rows_q8")
    np.testing.assert_allclose(np.asarray(got).reshape(3, 64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    ref = matmul(jnp.asarray(x), laid["gate_up"], "th,hki->tki", backend="xla")  # the reference de-quantizes it
    np.testing.assert_allclose(np.asarray(ref).reshape(3, 64), x @ w.T, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_einsum_and_embedding_equal_float(qtype):
    qk = FORMATS[qtype].qk
    k, inter = 2 * max(qk, 64), 48
    data, w = encoded(qtype, 2 * inter, k)  # gate rows then up rows: [2 * inter, k]
    gate_up = GGMLWeight(jnp.asarray(data).reshape(2, inter, -1), qtype)  # [2, inter, row_bytes]: logical [k, 2, inter]
    assert gate_up.shape == (k, 2, inter)
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    want = np.einsum("th,kih->tki", x.astype(np.float64), w.reshape(2, inter, k).astype(np.float64))
    for backend in ("xla", "cpu_rows"):
        got = matmul(jnp.asarray(x), gate_up, "th,hki->tki", backend=backend)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    linear = GGMLWeight(jnp.asarray(data), qtype)
    np.testing.assert_allclose(
        np.asarray(matmul(jnp.asarray(x), linear)), want.reshape(5, -1), rtol=2e-5, atol=2e-5 * np.abs(want).max()
    )
    table = GGMLWeight(jnp.asarray(data), qtype, transposed=False)
    ids = jnp.asarray([3, 0, 95, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(embedding_rows(table, ids)), w[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(table.dequantize()), w)
    with pytest.raises(ValueError, match="not a matmul weight"):
        matmul(jnp.asarray(x), table)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, smollm2_path):
    """A small random Llama GGUF in Q8_0 (tied embeddings; head_dim 64, rows of 256 values)."""
    out = tmp_path_factory.mktemp("ggml") / "tiny-q4_0.gguf"
    random_gguf.write(out, "q4_0", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, tokenizer_from=smollm2_path)
    return out


def test_load_keeps_blocks_shares_the_tied_table_and_skips_the_cache(tiny_gguf, tmp_path):
    cfg, params = load_model(tiny_gguf, cache=tmp_path / "cache")
    assert cfg.tie_word_embeddings
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))
    embed, head = params["embed"], params["lm_head"]
    assert isinstance(embed, GGMLWeight) and embed.qtype == "Q4_0" and not embed.transposed
    assert isinstance(head, GGMLWeight) and head.transposed and head.shape == (256, cfg.vocab_size)
    assert embed.data.unsafe_buffer_pointer() == head.data.unsafe_buffer_pointer()
    layer = params["layers"][0]
    assert {n for n, w in layer.items() if isinstance(w, GGMLWeight)} == {"wq", "wk", "wv", "wo", "w_gate_up", "w_down"}
    assert layer["attn_norm"].dtype == jnp.float32
    gf = GGUFFile(tiny_gguf)
    get, has = gguf_names.hf_view(gf, cfg)  # the same file de-quantized whole: what the loader did before
    floats = jax.tree.map(jnp.asarray, weight_map.hf_to_params(cfg, get, has, np.float32))
    ids = jnp.arange(40, dtype=jnp.int32) * 97 % cfg.vocab_size
    a, b = forward_dense(params, cfg, ids), forward_dense(floats, cfg, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


def test_engine_greedy_on_kept_blocks_equals_xla_and_the_kernels(tiny_gguf):
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 31]}, {"prompt_token_ids": list(range(100, 140))}]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("xla", "cpu_rows"):
        llm = LLM(str(tiny_gguf), matmul_backend=backend, max_num_seqs=4, max_model_len=128, warmup=False)
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert runs["xla"] == runs["cpu_rows"]
    assert all(len(t) == 12 for t in runs["xla"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_cpu_rows_q8_backend_rounds_the_activations_of_its_types(qtype):
    """ "cpu_rows_q8" multiplies the INT8_TYPES blocks by x rounded to int8 blocks (llama.cpp's arithmetic: float64 of
    the rounded x is the reference), and the types without an int8 path by x as it is."""
    n, k = 40, 256
    data, w = encoded(qtype, n, k)  # [n, k]: a row per output feature
    x = np.random.default_rng(2).standard_normal((6, k)).astype(np.float32)
    rounded = int8_rounded(x, qtype) if qtype in cpu_ggml_matmul.INT8_TYPES else x.astype(np.float64)
    want = rounded @ w.T.astype(np.float64)
    got = matmul(jnp.asarray(x), GGMLWeight(jnp.asarray(data), qtype), backend="cpu_rows_q8")
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_engine_on_int8_activations_stays_close_to_float(tiny_gguf):
    """The engine on "cpu_rows_q8" (every projection of the Q4_0 file on int8 activations, prefill included) gives
    the float path's logits to the activation rounding (measured 0.4% of the largest logit; bound 2%)."""
    opts = dict(max_num_seqs=4, max_model_len=128, warmup=False)
    ids = [1, 5, 9, 200, 31, 7, 7, 64]
    a = LLM(str(tiny_gguf), matmul_backend="xla", **opts).logits(ids)
    q8 = LLM(str(tiny_gguf), matmul_backend="cpu_rows_q8", **opts)
    b = q8.logits(ids)
    assert np.abs(b - a).max() <= 2e-2 * np.abs(a).max()
    out = q8.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.skipif(cpu_kernels.interleaved_rows() != 16, reason="this build reads no interleaved layout")
def test_engine_interleaves_a_q4_k_m_file_for_int8_activations(tmp_path, smollm2_path):
    """A Q4_K_M file served on "cpu_rows_q8" (a GGUF file's default) holds its Q4_K and Q6_K matmul weights
    interleaved (the tied table as stored): logits as with the rows as stored to the activations' rounding, and its
    weights can be swapped for `load_model`'s (re-laid on the way in)."""
    path = tmp_path / "tiny-q4_k_m.gguf"
    random_gguf.write(path, "q4_k_m", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, tokenizer_from=smollm2_path)
    opts = dict(max_num_seqs=4, max_model_len=128, warmup=False)
    llm = LLM(str(path), **opts)
    assert llm.engine.runner.matmul_backend == "cpu_rows_q8"
    kept = jax.tree.leaves(llm.engine.runner.params, is_leaf=lambda v: isinstance(v, GGMLWeight))
    qtypes = {w.qtype for w in kept if isinstance(w, GGMLWeight)}
    assert qtypes == {"Q4_K_X16", "Q6_K_X16", "Q6_K"}  # (the tied table: Q6_K)
    ids = [1, 5, 9, 200, 31, 7, 7, 64]
    a = llm.logits(ids)
    stored = LLM(str(path), matmul_backend="cpu_rows", **opts).logits(ids)  # float activations, Q4_K as stored
    assert np.abs(a - stored).max() <= 2e-2 * np.abs(stored).max()
    _, params = load_model(path)
    llm.engine.update_params(params)  # Q4_K as stored, q, k and v apart
    np.testing.assert_allclose(llm.logits(ids), a, rtol=0, atol=1e-5 * np.abs(a).max())


def test_no_compilation_after_warmup_on_kept_blocks(tiny_gguf):
    llm = LLM(str(tiny_gguf), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, warmup=True)
    assert isinstance(llm.engine.runner.params["layers"][0]["wqkv"], GGMLWeight)  # q, k and v's blocks joined
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 150))]} for _ in range(24)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 0.8]), seed=i) for i in range(24)
    ]
    with compiled_jits() as compiled:
        llm.generate(prompts, params, use_tqdm=False)
    assert compiled == []


_PEAK = """
import json, resource, sys
import netra_jax, jax, jax.numpy as jnp
from netra_jax.loader import load_model
jnp.zeros(1).block_until_ready()  # the runtime's own baseline: imported, a device up, nothing built
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg, params = load_model(sys.argv[1], cache=False)
jax.block_until_ready(params)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
held = sum({a.unsafe_buffer_pointer(): a.nbytes for a in jax.tree.leaves(params)}.values())  # a tied table once
print(json.dumps({"base": base, "peak": peak, "held": held}))
"""


def test_a_kept_load_holds_about_the_file_once(tmp_path, smollm2_path):
    """Peak RSS of the load over the runtime's baseline within 1.2x the file (a 90 MB Q8_0 file)."""
    path = tmp_path / "q8.gguf"
    random_gguf.write(path, "q8_0", hidden=1024, layers=4, heads=8, kv_heads=4, ffn=4096, tokenizer_from=smollm2_path)
    size = path.stat().st_size
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, env=env, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.95 * size <= m["held"] <= 1.05 * size  # the blocks as they are in the file
    assert m["peak"] - m["base"] <= 1.2 * size, (m, size)


@pytest.mark.parametrize("qc", [{"quant_method": "bitsandbytes"}, {"quant_method": "hqq", "bits": 4}, {"bits": 4}])
def test_a_checkpoint_quantized_by_an_unread_method_fails_in_one_line(tmp_path, qc):
    src = FIXTURES / "tiny-llama"
    d = tmp_path / "model"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(
        json.dumps(json.loads((src / "config.json").read_text()) | {"quantization_config": qc})
    )
    supported = r"\(supported: fp8, awq, gptq, compressed-tensors, mxfp4\)"
    with pytest.raises(CheckpointError, match=r"quant_method .* is not supported " + supported) as e:
        load_model(d)
    assert "\n" not in str(e.value)


def test_moe_file_keeps_attention_and_expert_blocks_and_reads_the_router_as_floats(tmp_path):
    path = requantized(REPO / "tests" / "fixtures" / "llamacpp-gguf" / "tiny-qwen3-moe.gguf", tmp_path / "moe-q8.gguf")
    assert {t.qtype for n, t in GGUFFile(path).tensors.items() if "ffn_gate_inp" in n or "_exps" in n} == {Q.Q8_0}
    cfg, kept = load_model(path, cache=False)
    _, floats = load_model(path, cache=False, keep_quantized=False)
    moe = next(lp for lp in kept["layers"] if "router" in lp)
    assert isinstance(moe["wq"], GGMLWeight) and moe["wq"].qtype == "Q8_0"
    assert not isinstance(moe["router"], GGMLWeight)
    for k in ("experts_gate_up", "experts_down"):  # per expert, the experts their batch axis
        w, f = moe[k], next(lp for lp in floats["layers"] if "router" in lp)[k]
        assert isinstance(w, GGMLWeight) and w.batch_dims == 1 and w.shape == f.shape
        np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(f))
    ids = jnp.arange(24, dtype=jnp.int32) * 7 % cfg.vocab_size
    a, b = forward_dense(kept, cfg, ids), forward_dense(floats, cfg, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
