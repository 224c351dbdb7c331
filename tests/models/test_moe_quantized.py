"""Quantized MoE experts: the grouped matmul over per-expert int8/fp8 values (scales applied after it) and over GGML
blocks (de-quantized per group, or on the CPU kernel) equals float64 numpy over the de-quantized experts, with
gradients in the activations; Qwen3-MoE and Mixtral GGUF files with Q8_0 / Q4_0 experts keep them in blocks and give
the de-quantized model's logits and greedy tokens, without compiling after warm-up; online quantization covers the
experts too, against the same model with its quantized experts de-quantized."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES
from support.compiles import compiled_jits
from support.hf_to_gguf import requantized

from netra_jax import LLM, SamplingParams
from netra_jax.loader import load_model
from netra_jax.models.moe import expert_matmul
from netra_jax.models.transformer import forward_dense
from netra_jax.ops import cpu_kernels
from netra_jax.quant import GGMLWeight, QuantizedWeight, quantize_params, quantize_weight
from netra_jax.quant.online import quantize_q4_0

GGUF_DIR = DATA / "llamacpp-gguf"
E, K, N, R = 4, 64, 48, 37
SIZES = np.array([10, 0, 20, 7])  # rows per expert; expert 1 has none


def _ggml_experts(w: np.ndarray, qtype: str) -> GGMLWeight:
    """float [E, K, N] -> GGML blocks of `qtype` by gguf.quants (llama.cpp's layout: [E, N, row_bytes])."""
    data = gguf.quants.quantize(np.ascontiguousarray(w.transpose(0, 2, 1)), gguf.GGMLQuantizationType[qtype])
    return GGMLWeight(jnp.asarray(data), qtype, batch_dims=1)


def _grouped_reference(rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 numpy: each row times its expert's [K, N] matrix."""
    expert = np.repeat(np.arange(E), SIZES)
    return np.einsum("rk,rkn->rn", rows.astype(np.float64), w.astype(np.float64)[expert])


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((E, K, N)).astype(np.float32) * rng.uniform(0.1, 2, (E, 1, N)).astype(np.float32)
    rows = rng.standard_normal((R, K)).astype(np.float32)
    quantized = {
        "int8": quantize_weight(jnp.asarray(w), "int8", 1),
        "fp8": quantize_weight(jnp.asarray(w), "fp8", 1),
        "int4": quantize_q4_0(jnp.asarray(w), 1),
        "Q8_0": _ggml_experts(w, "Q8_0"),
        "Q4_0": _ggml_experts(w, "Q4_0"),
    }
    return rows, w, quantized


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "Q8_0", "Q4_0"])
def test_grouped_matmul_over_quantized_experts_equals_float64(experts, kind):
    rows, w, quantized = experts
    qw = quantized[kind]
    deq = np.asarray(qw.dequantize(), np.float64)  # [E, K, N]
    assert deq.shape == w.shape
    if isinstance(qw, QuantizedWeight):
        assert qw.scale.shape == (E, N)  # per expert and output channel
    assert np.abs(deq - w).max() < 0.2 * np.abs(w).max()  # a quantization of w, not something else
    want = _grouped_reference(rows, deq)
    gs = jnp.asarray(SIZES, jnp.int32)
    expert = jnp.repeat(jnp.arange(E), gs, total_repeat_length=R)
    for mb in ("xla", "cpu_rows"):
        got = np.asarray(jax.jit(expert_matmul, static_argnums=4)(jnp.asarray(rows), qw, gs, expert, mb))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"{kind} {mb}")
    # gradient in the activations: that of the float grouped product with the de-quantized experts
    g = jax.grad(lambda r: jnp.sum(expert_matmul(r, qw, gs, expert) ** 2))(jnp.asarray(rows))
    y = want
    g_want = np.einsum("rn,rkn->rk", 2 * y, deq[np.repeat(np.arange(E), SIZES)])
    np.testing.assert_allclose(np.asarray(g), g_want, rtol=1e-4, atol=1e-4 * np.abs(g_want).max())


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")
def test_cpu_rows_reads_expert_blocks_and_int8_on_the_kernels(experts):
    rows, _, quantized = experts
    gs = jnp.asarray(SIZES, jnp.int32)
    expert = jnp.repeat(jnp.arange(E), gs, total_repeat_length=R)

    def hlo(kind, mb):
        fn = jax.jit(expert_matmul, static_argnums=4)
        return fn.lower(jnp.asarray(rows), quantized[kind], gs, expert, mb).as_text()

    for kind, target in (("Q4_0", "netra_ggml_matmul_f32"), ("int8", "netra_small_matmul_i8")):
        assert target in hlo(kind, "cpu_rows")
        assert target not in hlo(kind, "xla")


def _moe_layer(params):
    return next(lp for lp in params["layers"] if "router" in lp)


@pytest.mark.parametrize("name,qtype", [("tiny-qwen3-moe", "Q8_0"), ("tiny-mixtral", "Q4_0")])
def test_gguf_experts_kept_in_blocks_equal_the_dequantized_model(name, qtype, tmp_path):
    path = requantized(GGUF_DIR / f"{name}.gguf", tmp_path / f"{name}-{qtype}.gguf", qtype)
    cfg, kept = load_model(path, cache=False)
    _, floats = load_model(path, cache=False, keep_quantized=False)  # the reference: every tensor de-quantized
    lp = _moe_layer(kept)
    for k in ("experts_gate_up", "experts_down"):
        assert isinstance(lp[k], GGMLWeight) and lp[k].qtype == qtype and lp[k].batch_dims == 1
        assert lp[k].shape == _moe_layer(floats)[k].shape
    assert not isinstance(lp["router"], GGMLWeight)
    ids = jnp.arange(40, dtype=jnp.int32) * 11 % cfg.vocab_size
    a, b = forward_dense(kept, cfg, ids), forward_dense(floats, cfg, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))

    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 31]}, {"prompt_token_ids": list(range(100, 140))}]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    opts = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, warmup=False)
    runs = {}
    # the kernel on float activations: the exact de-quantized products (the default rounds them to int8)
    for label, kw in {"xla": dict(matmul_backend="xla"), "kernel": dict(matmul_backend="cpu_rows")}.items():
        llm = LLM(str(path), **kw, **opts)
        runs[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    dequantized = requantized(path, tmp_path / f"{name}-{qtype}-f32.gguf", "F32")  # the same values, in float
    llm = LLM(str(dequantized), **opts)
    runs["dequantized"] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert runs["xla"] == runs["kernel"] == runs["dequantized"]


def test_no_compilation_after_warmup_on_quantized_experts(tmp_path):
    path = requantized(GGUF_DIR / "tiny-qwen3-moe.gguf", tmp_path / "moe-q4_0.gguf", "Q4_0")
    llm = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, warmup=True)
    assert isinstance(_moe_layer(llm.engine.runner.params)["experts_down"], GGMLWeight)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, rng.integers(1, 100)).tolist()} for _ in range(12)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 16)), temperature=0.0) for _ in range(12)]
    with compiled_jits() as compiled:
        llm.generate(prompts, params, use_tqdm=False)
    assert compiled == []


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_online_quantization_covers_the_experts(name, method):
    cfg, params = load_model(FIXTURES / name, "float32", cache=False)
    q = quantize_params(params, method)
    lp = _moe_layer(q)
    for k in ("experts_gate_up", "experts_down"):
        assert isinstance(lp[k], (QuantizedWeight, GGMLWeight)) and lp[k].batch_dims == 1, (k, type(lp[k]))
        assert lp[k].shape == _moe_layer(params)[k].shape
    assert not isinstance(lp["router"], (QuantizedWeight, GGMLWeight))  # the router stays float
    # the reference: the same parameters with the quantized experts de-quantized to float32 arrays
    deq = {**q, "layers": [{k: _dequantized(k, v) for k, v in layer.items()} for layer in q["layers"]]}
    ids = jnp.arange(30, dtype=jnp.int32) * 13 % cfg.vocab_size
    a, b = forward_dense(q, cfg, ids), forward_dense(deq, cfg, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


def _dequantized(name: str, w):
    return w.dequantize() if name.startswith("experts_") and hasattr(w, "dequantize") else w


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_lower_for_gpu_as_the_per_expert_loop(method):
    """Lowered for an (abstract) H200, quantized experts run the loop over the experts that have rows (their blocks
    or values de-quantized there): neither XLA's ragged dot over every expert nor a CPU kernel."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from netra_jax.models.moe import moe_mlp

    cfg, params = load_model(FIXTURES / "tiny-qwen3-moe", "float32", cache=False)
    lp = _moe_layer(quantize_params(params, method))
    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    x = jax.ShapeDtypeStruct((16, cfg.hidden_size), jnp.float32)
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=gpu)):
        lowered = jax.jit(moe_mlp, static_argnums=2).trace(x, lp, cfg).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ragged_dot" not in text and "netra_ggml_matmul_f32" not in text
    assert "stablehlo.while" in text
