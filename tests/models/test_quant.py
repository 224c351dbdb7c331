"""Online weight-only quantization (int8, fp8, int4): per-channel round trip bounds, int4's Q4_0 blocks byte-equal to
llama.cpp's rounding (gguf.quants), logits close to float32 on a fixture, and the SmolLM2 accuracy (greedy
agreement, logit error) reported with the int8 engine end to end (its GGUF file re-quantized from float)."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, SamplingParams
from netra_jax.ops.ggml_blocks import quantize_rows_q4_0
from netra_jax.quant import (
    BlockFP8Weight,
    GGMLWeight,
    PackedIntWeight,
    QuantizedWeight,
    concatenate_outputs,
    matmul,
    quantize_params,
    quantize_weight,
)


def test_quantize_weight_per_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 2, 48)).astype(np.float32) * rng.uniform(0.01, 3, (1, 2, 48)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w))
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (2, 48)
    deq = np.asarray(qw.q, np.float32) * np.asarray(qw.scale)
    assert np.all(np.abs(deq - w) <= np.asarray(qw.scale) / 2 + 1e-7)  # half a step per channel
    x = rng.standard_normal((5, 64)).astype(np.float32)
    got = np.asarray(matmul(jnp.asarray(x), qw, "th,hki->tki"))
    np.testing.assert_allclose(got, np.einsum("th,hki->tki", x, deq), rtol=1e-5, atol=1e-5)


def test_fp8_per_channel_within_e4m3_rounding():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 40)).astype(np.float32) * rng.uniform(0.01, 3, (1, 40)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w), "fp8")
    assert qw.q.dtype == jnp.float8_e4m3fn and qw.scale.shape == (40,)
    deq = np.asarray(qw.q, np.float32) * np.asarray(qw.scale)
    assert np.all(np.abs(deq - w) <= np.abs(w) / 16 + np.asarray(qw.scale) * 2.0**-9)  # 3 mantissa bits
    x = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), qw)), x @ deq, rtol=1e-5, atol=1e-5)


def test_int4_blocks_equal_llama_cpp_rounding():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # a zero block: scale 0, every value 8
    x[2, :32] = -x[2, :32] * 4  # negative extremes
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(np.asarray(quantize_rows_q4_0(jnp.asarray(x))), want)


@pytest.mark.parametrize(
    "method, kind, tol", [("int8", jnp.int8, 0.05), ("fp8", jnp.float8_e4m3fn, 0.1), ("int4", None, 0.5)]
)
def test_online_methods_fixture_logits_close_and_engine_runs(method, kind, tol):
    name = "tiny-qwen3"
    f32 = LLM(FIXTURES / name, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=64)
    q = LLM(
        FIXTURES / name, dtype="float32", quantization=method, warmup=False, max_num_seqs=4, max_num_batched_tokens=64
    )
    layer = q.engine.runner.params["layers"][0]
    wq = layer.get("wq", layer.get("wqkv"))  # q, k and v joined on CPU where they are of one kind
    if kind is None:
        assert isinstance(wq, GGMLWeight) and wq.qtype == "Q4_0"
    else:
        assert isinstance(wq, QuantizedWeight) and wq.q.dtype == kind
    case = reference(name)["cases"][0]
    a, b = f32.logits(case["prompt_ids"]), q.logits(case["prompt_ids"])
    err = np.abs(a - b).max() / np.abs(a).max()
    print(f"{method}: logits max error {err:.4f} of the largest logit")
    assert 0 < err < tol
    out = q.generate(
        {"prompt_token_ids": case["prompt_ids"]}, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_quantize_params_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_params({"layers": [], "lm_head": jnp.zeros((2, 2))}, "int3")


@pytest.mark.slow
def test_int8_smollm2_accuracy_reported(smollm2_path, record_property):
    ref = reference("smollm2")["cases"]
    f32 = LLM(smollm2_path, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=128)
    q8 = LLM(
        smollm2_path, dtype="float32", quantization="int8", warmup=False, max_num_seqs=4, max_num_batched_tokens=128
    )
    sp = SamplingParams(max_tokens=48, temperature=0)
    errs, agree = [], []
    for case in ref:
        a, b = f32.logits(case["prompt_ids"])[-1], q8.logits(case["prompt_ids"])[-1]
        errs.append(float(np.abs(a - b).max()))
        out = q8.chat(case["messages"], sp, use_tqdm=False)[0].outputs[0]
        n = min(len(out.token_ids), len(case["greedy_ids"]))
        same = next((i for i in range(n) if out.token_ids[i] != case["greedy_ids"][i]), n)
        agree.append(same / len(case["greedy_ids"]))
        print(f"int8: last-logit max err {errs[-1]:.3f}, greedy prefix agreement {agree[-1]:.2f}: {out.text!r}")
    record_property("int8_max_logit_err", max(errs))
    record_property("int8_greedy_prefix_agreement", agree)
    assert max(errs) < 3.0 and np.mean(agree) > 0.25


@pytest.mark.parametrize(
    "bits,group,zeros,act_order", [(4, 32, True, False), (4, 64, False, True), (8, 32, True, True)]
)
def test_packed_int_weight_dequantizes_gptq_layout(bits, group, zeros, act_order):
    """PackedIntWeight reads GPTQ's layout (values packed along K into int32 words, low bits first) and equals
    (q - zero) * scale computed in numpy, for the symmetric and the zero-point forms and an act-order g_idx."""
    rng = np.random.default_rng(bits + group)
    k, n = 128, 24
    q = rng.integers(0, 1 << bits, size=(k, n))  # [K, N] unsigned values
    per = 32 // bits
    packed = np.zeros((k // per, n), np.uint32)
    for j in range(per):
        packed |= q[j::per].astype(np.uint32) << np.uint32(bits * j)
    g_idx = rng.permutation(np.arange(k) // group) if act_order else np.arange(k) // group
    scale = rng.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float16)
    zero = rng.integers(0, 1 << bits, size=(k // group, n)) if zeros else np.full((k // group, n), 1 << (bits - 1))
    w = PackedIntWeight(
        packed=jnp.asarray(packed.view(np.int32)),
        scale=jnp.asarray(scale),
        zero=jnp.asarray(zero, jnp.int32) if zeros else None,
        g_idx=jnp.asarray(g_idx, jnp.int32) if act_order else None,
        bits=bits,
        group=group,
        shape=(k, n),
    )
    want = ((q - zero[g_idx]).astype(np.float16) * scale[g_idx]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(w.values()), q)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), want)
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), w)), x @ want, rtol=1e-5, atol=1e-5)


def test_block_fp8_weight_scales_each_tile_partial_ones_included():
    """w[k, n] = q[k, n] * scale[k // bk, n // bn] against float64 numpy, with partial last tiles on both axes."""
    rng = np.random.default_rng(3)
    k, n, (bk, bn) = 200, 72, (64, 32)
    q = rng.standard_normal((k, n)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(4, 3)).astype(np.float32)  # ceil(200 / 64), ceil(72 / 32)
    w = BlockFP8Weight(jnp.asarray(q), jnp.asarray(scale), (bk, bn), (k, n))
    want = q.astype(np.float64) * scale[np.arange(k)[:, None] // bk, np.arange(n)[None, :] // bn]
    np.testing.assert_allclose(np.asarray(w.dequantize()), want, rtol=1e-7)
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), w)), x @ want, rtol=1e-5, atol=1e-4)


def _packed(rng, k: int, n: int, g_idx: np.ndarray) -> PackedIntWeight:
    q = rng.integers(0, 16, size=(k, n))
    packed = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        packed |= q[j::8].astype(np.uint32) << np.uint32(4 * j)
    scale = rng.uniform(0.01, 0.1, size=(k // 32, n)).astype(np.float16)
    zero = rng.integers(0, 16, size=(k // 32, n)).astype(np.int32)
    return PackedIntWeight(packed.view(np.int32), scale, zero, g_idx, 4, 32, (k, n))


def test_concatenate_outputs_fuses_exactly_and_refuses_what_cannot_share_a_layout():
    rng = np.random.default_rng(4)
    g_idx = rng.permutation(np.arange(128) // 32).astype(np.int32)
    gate, up = _packed(rng, 128, 24, g_idx), _packed(rng, 128, 24, g_idx)
    fused = concatenate_outputs([gate, up], (128, 2, 24))
    want = np.stack([np.asarray(gate.dequantize()), np.asarray(up.dequantize())], axis=1)  # [K, 2, N]
    np.testing.assert_array_equal(np.asarray(fused.dequantize()), want)
    q8 = np.ones((16, 8), ml_dtypes.float8_e4m3fn)
    fused = concatenate_outputs([QuantizedWeight(q8, np.full(8, 2.0, np.float32))] * 2, (16, 2, 8))
    assert fused.q.shape == (16, 2, 8) and fused.scale.shape == (2, 8)
    with pytest.raises(ValueError, match="g_idx differ"):
        concatenate_outputs([gate, _packed(rng, 128, 24, np.roll(g_idx, 1))], (128, 48))
    tiles = BlockFP8Weight(np.ones((64, 48), ml_dtypes.float8_e4m3fn), np.ones((1, 2), np.float32), (64, 32), (64, 48))
    with pytest.raises(ValueError, match="not whole tiles"):
        concatenate_outputs([tiles, tiles], (64, 2, 48))
    with pytest.raises(ValueError, match="different types"):
        concatenate_outputs([gate, tiles], (128, 72))
