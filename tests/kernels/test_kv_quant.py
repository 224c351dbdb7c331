"""The quantized KV cache (int8, fp8 e4m3 / e5m2 with a float32 scale per token and KV head): quantization against
numpy and ml_dtypes, the KV write, every attention backend against the jnp reference (itself against float64 over the
de-quantized pages), the C++ kernel's other instruction-set builds, the dense backward, and who refuses it."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.attention_cases import DECODE, MIXED, SINKS, dense, make_case

from netra_jax.config import ConfigError
from netra_jax.engine_config import EngineConfig
from netra_jax.ops import cpu_attention, cpu_kernels
from netra_jax.ops.attention import (
    BACKENDS,
    AttentionWork,
    attention,
    auto_backend,
    build_work,
    paged_attention_dense,
    with_token_layout,
    write_kv,
)
from netra_jax.ops.kv_quant import QuantizedPages, dequantize, dequantize_pages, empty_pages, quantize, storage_dtype
from netra_jax.ops.paged_attention_mosaic import paged_attention_mosaic_interpret
from netra_jax.ops.paged_attention_triton import fp8_bits_to_float

DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
# (relative step of the format's normal numbers, its smallest subnormal step) relative to a vector's scale
FP8_STEPS = {"fp8_e4m3": (2.0**-3, 2.0**-9), "fp8_e5m2": (2.0**-2, 2.0**-16)}
NUMPY_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def quantized_case(seqs, name, **shape):
    """make_case's batch with its K and V pages quantized to DTYPES[name]."""
    q, k, v, md = make_case(seqs, dtype=jnp.float32, pad_tokens=3, pad_seqs=2, **shape)
    dt = DTYPES[name]
    return q, QuantizedPages(*quantize(k, dt)), QuantizedPages(*quantize(v, dt)), md


def with_work(md, seqs, T):
    S = md.seq_lens.shape[0]
    return md.replace(work=AttentionWork(*(jnp.asarray(a) for a in build_work([n for _, n in seqs], T, S))))


# ------------------------------------------------------------------------------------------ the format


@pytest.mark.parametrize("name", list(DTYPES))
def test_quantize_matches_numpy_and_bounds_the_error(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3, 64)) * np.exp(rng.uniform(-6, 6, (40, 3, 1)))  # magnitudes over 5 decades
    x[3, 1] = 0.0  # an all-zero vector: scale 0, values 0
    x = x.astype(np.float32)
    values, scales = quantize(jnp.asarray(x), DTYPES[name])
    values, scales = np.asarray(values), np.asarray(scales)
    qmax = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[name]
    want_scales = np.abs(x.astype(np.float64)).max(-1) / qmax
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
    assert scales[3, 1] == 0 and not values[3, 1].astype(np.float32).any()
    y = x / np.where(scales > 0, scales, 1)[..., None]
    if name == "int8":
        np.testing.assert_array_equal(values, np.clip(np.round(y), -127, 127).astype(np.int8))
        bound = scales[..., None] / 2 * 1.0001  # half a step
    else:
        np.testing.assert_array_equal(values.view(np.uint8), y.astype(NUMPY_FP8[name]).view(np.uint8))
        rel, sub = FP8_STEPS[name]
        bound = np.maximum(np.abs(x) * rel / 2, sub / 2 * scales[..., None]) * 1.0001  # half a step
    err = np.abs(np.asarray(dequantize(jnp.asarray(values), jnp.asarray(scales)), np.float64) - x)
    assert (err <= bound + 1e-30).all()
    # the largest element of each vector is stored exactly at the format's top
    top = np.abs(np.asarray(values, np.float32)).max(-1)
    np.testing.assert_array_equal(top[scales > 0], qmax)


def test_storage_dtypes_of_the_names():
    assert storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert storage_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn
    assert storage_dtype("fp8_e5m2", jnp.float32) == jnp.float8_e5m2
    assert storage_dtype("int8", jnp.bfloat16) == jnp.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'int4'"):
        storage_dtype("int4", jnp.float32)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_write_kv_quantizes_into_the_slots(name, tokens):
    rng = np.random.default_rng(tokens)
    num_pages, P, KH, D = 5, 4, 2, 16
    kp = empty_pages((num_pages, P, KH, D), DTYPES[name])
    vp = empty_pages((num_pages, P, KH, D), DTYPES[name])
    k = rng.standard_normal((tokens + 1, KH, D)).astype(np.float32)
    v = rng.standard_normal((tokens + 1, KH, D)).astype(np.float32)
    slots = rng.choice(num_pages * P, tokens, replace=False).astype(np.int32)
    slots = np.append(slots, num_pages * P)  # a padding token: dropped
    kp, vp = jax.jit(write_kv)(kp, vp, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    assert isinstance(kp, QuantizedPages) and kp.scales.shape == (num_pages, P, KH)
    for pages, x in ((kp, k), (vp, v)):
        got = np.asarray(dequantize_pages(pages)).reshape(num_pages * P, KH, D)
        want = np.zeros_like(got)
        want[slots[:-1]] = np.asarray(dequantize(*quantize(jnp.asarray(x[:-1]), DTYPES[name])))
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------ the backends

CASES = {
    "mixed": (MIXED, {}, dict(G=2, D=64, P=16, KH=2)),
    "window_softcap_sinks": (MIXED, dict(sliding_window=9, soft_cap=2.0, sinks=SINKS[:6]), dict(G=3, D=80, P=16, KH=2)),
    "decode": (DECODE, {}, dict(G=4, D=64, P=32, KH=1)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(DTYPES))
def test_reference_and_cpu_backend_on_a_quantized_cache(case, name):
    """The reference (per-token and query-block paths) against float64 attention over the de-quantized pages; the
    "cpu" backend's kernel against the reference."""
    seqs, kw, shape = CASES[case]
    q, kq, vq, md = quantized_case(seqs, name, **shape)
    kw = dict(kw, sinks=jnp.asarray(kw["sinks"])) if "sinks" in kw else kw
    want = dense(q, dequantize_pages(kq), dequantize_pages(vq), md, scale=0.125, **kw)
    attend = jax.jit(lambda q, k, v, md, b: BACKENDS[b](q, k, v, md, scale=0.125, **kw), static_argnums=4)
    md = with_work(md, seqs, q.shape[0])
    ref = attend(q, kq, vq, md, "reference")
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=2e-5)
    if not cpu_kernels.available():
        pytest.skip(f"the C++ kernels are not built: {cpu_kernels.unavailable_reason()}")
    assert "netra_token_attention_f32" in attend.lower(q, kq, vq, md, "cpu").as_text()
    np.testing.assert_allclose(np.asarray(attend(q, kq, vq, md, "cpu")), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(DTYPES))
def test_triton_kernel_on_a_quantized_cache(name):
    """The Triton kernel, interpreted, reading int8 / fp8 tiles and their scales (split-K decode rows and prefill
    rows with a window) against the reference."""
    for seqs, kw, shape in (CASES["mixed"], CASES["window_softcap_sinks"]):
        q, kq, vq, md = quantized_case(seqs, name, **shape)
        kw = dict(kw, sinks=jnp.asarray(kw["sinks"])) if "sinks" in kw else kw
        ref = BACKENDS["reference"](q, kq, vq, md, scale=0.125, **kw)
        got = BACKENDS["triton_interpret"](q, kq, vq, md, scale=0.125, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_triton_fp8_widening_from_bits_matches_ml_dtypes(name):
    """Every finite fp8 bit pattern, widened from its uint8 bits as the Triton kernel does, is ml_dtypes' value."""
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(NUMPY_FP8[name]).astype(np.float32)
    got = np.asarray(fp8_bits_to_float(jnp.asarray(bits), DTYPES[name]))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])


def test_bf16_queries_over_a_quantized_cache():
    """bfloat16 queries: the reference de-quantizes to float32, the Triton kernel widens to bfloat16 (exact for int8)
    and applies the scales in float32."""
    q, kq, vq, md = quantized_case(MIXED, "int8", G=2, D=64, P=16, KH=2)
    q = q.astype(jnp.bfloat16)
    ref = BACKENDS["reference"](q, kq, vq, md, scale=0.125)
    want = dense(q, dequantize_pages(kq), dequantize_pages(vq), md, scale=0.125)
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, atol=3e-2, rtol=3e-2)
    got = BACKENDS["triton_interpret"](q, kq, vq, md, scale=0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


def test_mosaic_refuses_a_quantized_cache_by_name():
    q, kq, vq, md = quantized_case(MIXED, "int8", G=2, D=64, P=16, KH=2)
    with pytest.raises(ValueError, match="Mosaic GPU attention kernel does not support a int8 KV cache"):
        paged_attention_mosaic_interpret(q.astype(jnp.bfloat16), kq, vq, md, scale=0.125)
    for backend in ("mosaic", "mosaic_interpret"):
        with pytest.raises(ConfigError, match=f"attention_backend '{backend}' cannot read a fp8 KV cache"):
            EngineConfig(attention_backend=backend, kv_cache_dtype="fp8")
    EngineConfig(attention_backend="triton_interpret", kv_cache_dtype="fp8")  # the others read it
    EngineConfig(attention_backend="mosaic_interpret", kv_cache_dtype="bfloat16")
    # "auto" on Hopper runs Triton over a quantized cache
    shape = dict(dtype=jnp.bfloat16, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
    assert auto_backend("gpu", "9.0", kv_dtype=jnp.bfloat16, **shape) == "mosaic"
    assert auto_backend("gpu", "9.0", kv_dtype=jnp.int8, **shape) == "triton"
    assert auto_backend("gpu", "9.0", kv_dtype=jnp.float8_e4m3fn, **shape) == "triton"


def test_gradient_in_q_through_a_quantized_cache():
    """attention's backward (the dense reference's VJP) over de-quantized pages: the same gradient as over the
    de-quantized float pages."""
    q, kq, vq, md = quantized_case(MIXED, "fp8_e4m3", G=2, D=64, P=16, KH=2)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    kf, vf = dequantize_pages(kq), dequantize_pages(vq)
    got = jax.grad(lambda q: (attention(q, kq, vq, md, scale=0.125, backend="cpu") * w).sum())(q)
    want = jax.grad(lambda q: (paged_attention_dense(q, kf, vf, md, scale=0.125) * w).sum())(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ other kernel builds

BUILDS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],
    "portable": ["-march=x86-64", "-mtune=generic"],
}


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory):
    """FFI target name per build of cpu_attention.cc for another instruction set, compiled in parallel."""
    if cpu_kernels._compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the other builds are x86-64 instruction sets")
    out = tmp_path_factory.mktemp("attention_builds")
    source = cpu_kernels.HERE / "cpu_attention.cc"
    return cpu_kernels.register_builds(source, "NetraTokenAttentionF32", cpu_attention.TARGET, BUILDS, out)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("name", [*DTYPES, "float32"])
def test_other_builds_match_the_reference(other_builds, build, name):
    """Every token through another build's kernel against the reference's per-token path (no work lists)."""
    seqs, kw, shape = CASES["window_softcap_sinks"]
    if name == "float32":
        q, kq, vq, md = make_case(seqs, dtype=jnp.float32, pad_tokens=3, pad_seqs=2, **shape)
    else:
        q, kq, vq, md = quantized_case(seqs, name, **shape)
    kw = dict(kw, sinks=jnp.asarray(kw["sinks"]))
    ref = BACKENDS["reference"](q, kq, vq, md, scale=0.125, **kw)
    T = q.shape[0]
    lay = with_token_layout(md, T).layout
    idx = jnp.arange(T, dtype=jnp.int32)
    args = (q, kq, vq, idx, jnp.int32(T), lay.q_pos, lay.valid, lay.rows)
    got = cpu_attention.token_attention(*args, scale=0.125, **kw, target=other_builds[build])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)
