"""The "gpu" matmul backend and its load-time layout, on CPU: GGUF Q4_0 / Q8_0 blocks and int8 weights re-laid as
PackedIntWeight hold exactly the values llama.cpp's numpy de-quantization (gguf.quants) and the int8 reference give,
the other GGML types are de-quantized and embedding tables stay blocks; the backend's products (the packed kernel in
the interpreter, "gpu_interpret") equal the jnp reference, for plain and several-output-axis weights; the engine
serves an int4-quantized fixture model on them with the logits of the GGML reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax import LLM
from netra_jax.quant import (
    GGMLWeight,
    PackedIntWeight,
    QuantizedWeight,
    matmul,
    quantize_weight,
    reference_matmul,
    weight_layout,
)
from netra_jax.quant.repack import for_gpu, pack_along_k, packed_from_ggml, packed_from_int8

FIXTURES = Path("/work/shared/fixtures")


def _ggml(w: np.ndarray, qtype: str) -> GGMLWeight:
    """w [K, *out] float32 as llama.cpp's blocks of `qtype` (gguf.quants), rows = output features."""
    rows = w.reshape(w.shape[0], -1).T
    data = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    return GGMLWeight(jnp.asarray(data).reshape(*w.shape[1:], -1), qtype, True, jnp.dtype(jnp.float32))  # [*out, rb]


def _with_float32_scales(p: PackedIntWeight) -> PackedIntWeight:
    return dataclasses.replace(p, scale=p.scale.astype(jnp.float32))


def test_pack_along_k_is_gptq_layout():
    q = np.random.default_rng(0).integers(0, 16, (64, 5))
    packed = np.asarray(pack_along_k(jnp.asarray(q, jnp.int32), 4)).view(np.uint32)
    for j in range(8):  # value j of word i is row 8 * i + j at bits [4j, 4j + 4)
        np.testing.assert_array_equal((packed >> np.uint32(4 * j)) & 15, q[j::8])
    with pytest.raises(ValueError, match="K=10"):
        pack_along_k(jnp.zeros((10, 2), jnp.int32), 8)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_ggml_blocks_repack_to_the_same_values(qtype):
    """The repacked weight is llama.cpp's de-quantization exactly (with its fp16 d widened to float32, as gguf's
    numpy does) and within float16's rounding in PackedIntWeight's own float16 arithmetic."""
    w = np.random.default_rng(1).standard_normal((96, 2, 24)).astype(np.float32)
    blocks = _ggml(w, qtype)
    rows = np.asarray(blocks.data).reshape(-1, blocks.data.shape[-1])  # [N, row_bytes]
    want = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).T.reshape(w.shape)
    p = packed_from_ggml(blocks)
    assert p.bits == (4 if qtype == "Q4_0" else 8) and p.group == 32 and p.zero is None and p.shape == w.shape
    assert p.scale.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(_with_float32_scales(p).dequantize()), want)
    np.testing.assert_allclose(np.asarray(p.dequantize()), want, rtol=2**-11, atol=1e-6)


def test_int8_repacks_to_the_same_values():
    qw = quantize_weight(jnp.asarray(np.random.default_rng(2).standard_normal((64, 3, 8)), jnp.float32), "int8")
    p = packed_from_int8(qw)
    assert (p.bits, p.group, p.shape) == (8, 64, (64, 3, 8))
    np.testing.assert_array_equal(np.asarray(p.dequantize()), np.asarray(qw.dequantize()))
    assert packed_from_int8(quantize_weight(jnp.ones((32, 4)), "fp8")) is None


def test_for_gpu_layout():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    embed = _ggml(rng.standard_normal((32, 64)).astype(np.float32), "Q4_0")
    embed = dataclasses.replace(embed, transposed=False)  # a table read by rows
    fp8 = quantize_weight(jnp.asarray(w), "fp8")
    other = _ggml(rng.standard_normal((64, 4)).astype(np.float32), "Q4_1")
    params = {"embed": embed, "layers": [{"wq": _ggml(w, "Q4_0"), "wo": _ggml(w, "Q8_0"), "wk": fp8, "wv": other}]}
    out = for_gpu(params)
    lp = out["layers"][0]
    assert isinstance(lp["wq"], PackedIntWeight) and isinstance(lp["wo"], PackedIntWeight)
    assert lp["wk"] is fp8 and out["embed"] is embed
    assert isinstance(lp["wv"], jnp.ndarray)  # no GPU kernel reads Q4_1: de-quantized at load
    np.testing.assert_array_equal(np.asarray(lp["wv"]), np.asarray(other.dequantize()))
    assert weight_layout(params, "xla") is params and weight_layout(params, "gpu")["embed"] is embed


@pytest.mark.parametrize("spec", [None, "th,hki->tki"], ids=["plain", "gate_up"])
def test_gpu_backend_matches_the_reference(spec):
    rng = np.random.default_rng(4)
    shape = (96, 40) if spec is None else (96, 2, 20)
    w = packed_from_ggml(_ggml(rng.standard_normal(shape).astype(np.float32), "Q4_0"))
    x = jnp.asarray(rng.standard_normal((7, 96)), jnp.float32)
    got = matmul(x, w, spec, backend="gpu_interpret")
    want = reference_matmul(x, w, spec)
    assert got.shape == (7, *shape[1:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_gpu_backend_leaves_other_weights_to_the_reference():
    x = jnp.ones((2, 32), jnp.float32)
    q = QuantizedWeight(jnp.ones((32, 8), jnp.float8_e4m3fn), jnp.full((8,), 0.5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(matmul(x, q, backend="gpu_interpret")), 16.0)  # no fp8 on CPU
    np.testing.assert_array_equal(np.asarray(matmul(x, jnp.ones((32, 3)), backend="gpu_interpret")), 32.0)


def test_engine_serves_int4_on_the_packed_kernel():
    """--quantization int4 with the "gpu_interpret" backend: the projections are PackedIntWeight (Q4_0's values) and
    the logits are the GGML reference's (the xla backend on the same Q4_0 blocks) up to float16 scale rounding."""
    kw = dict(dtype="float32", quantization="int4", warmup=False, max_num_seqs=2, max_num_batched_tokens=32)
    ref = LLM(FIXTURES / "tiny-llama", matmul_backend="xla", **kw)
    gpu = LLM(FIXTURES / "tiny-llama", matmul_backend="gpu_interpret", **kw)
    lp = gpu.engine.runner.params["layers"][0]
    assert isinstance(lp["wq"], PackedIntWeight) and isinstance(lp["w_gate_up"], PackedIntWeight)
    ref_layer = ref.engine.runner.params["layers"][0]
    assert isinstance(ref_layer.get("wq", ref_layer.get("wqkv")), GGMLWeight)  # q, k and v joined on CPU
    ids = [1, 5, 9, 13, 2, 7]
    a, b = ref.logits(ids), gpu.logits(ids)
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())
