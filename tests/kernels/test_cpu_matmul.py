"""The CPU few-row matmul kernels (netra_jax/ops/cpu_matmul.cc), float32, int8 and fp8 e4m3 weights, against float64
numpy over the shapes their tiling splits (row tiles, column panels, single vectors, leftover columns, partial K
blocks), their fallbacks, derivatives and build cache, and the engine running them: the steps that take them call
them, the others do not, and greedy tokens match transformers' references and XLA's dot."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, SamplingParams
from netra_jax.config import ConfigError
from netra_jax.engine_config import EngineConfig
from netra_jax.ops import cpu_kernels, cpu_matmul
from netra_jax.quant import matmul, quantize_weight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the kernel")

# (M, K, N): 1..32 rows (the row stream up to 4, whole and partial row tiles beyond); N = whole panels, panels
# plus single vectors, plus a few columns, fewer columns than a vector; K = partial and whole blocks of 32 rows, and 1;
# rows of w longer than the row stream's run (4096 float32 columns): whole runs, a partial last one, a tail
SHAPES = [
    (1, 64, 48),
    (1, 1536, 576),
    (2, 64, 48),
    (3, 100, 77),
    (8, 576, 1536),
    (9, 33, 200),
    (13, 1536, 576),
    (16, 7, 3),
    (31, 1, 130),
    (32, 576, 192),
    (5, 96, 4100),
    (1, 40, 9000),
    (4, 33, 20483),
]


@pytest.mark.parametrize("M, K, N", SHAPES)
def test_kernel_matches_float64(M, K, N):
    rng = np.random.default_rng(M * 1000 + N)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32)
    assert cpu_matmul.takes(jnp.asarray(x), jnp.asarray(w))
    y = np.asarray(jax.jit(cpu_matmul.rows_matmul)(x, w))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.sqrt(K) * np.abs(ref).max() + 1e-30  # float32 error of a K-term sum
    assert y.shape == (M, N) and y.dtype == np.float32
    np.testing.assert_array_less(np.abs(y - ref), 1e-6 * scale)
    assert "netra_small_matmul_f32" in jax.jit(cpu_matmul.rows_matmul).lower(x, w).as_text()


@pytest.mark.parametrize("M, dtype", [(33, jnp.float32), (8, jnp.bfloat16)], ids=["33-rows", "bf16"])
def test_other_shapes_and_dtypes_run_xla_dot(M, dtype):
    x = jnp.ones((M, 16), dtype)
    w = jnp.ones((16, 24), dtype)
    assert not cpu_matmul.takes(x, w)
    text = jax.jit(cpu_matmul.rows_matmul).lower(x, w).as_text()
    assert "netra_small_matmul_f32" not in text
    np.testing.assert_array_equal(np.asarray(cpu_matmul.rows_matmul(x, w)), np.asarray(jnp.dot(x, w)))


def test_matmul_backend_einsum_form_and_quantized():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((6, 40), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((40, 2, 24), dtype=np.float32))
    got = matmul(x, w, "th,hki->tki", backend="cpu_rows")  # w flattened to [40, 48] for the kernel
    np.testing.assert_allclose(np.asarray(got), np.einsum("th,hki->tki", x, w), rtol=1e-5, atol=1e-5)
    assert (
        "netra_small_matmul_f32"
        in jax.jit(lambda x, w: matmul(x, w, "th,hki->tki", backend="cpu_rows")).lower(x, w).as_text()
    )
    with pytest.raises(ValueError, match="unknown matmul backend 'blas'"):
        matmul(x, w[:, 0], backend="blas")


def test_derivatives_are_jnp_dots():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((8, 40), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((40, 56), dtype=np.float32))

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    got = jax.grad(loss(cpu_matmul.rows_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    _, t = jax.jvp(cpu_matmul.rows_matmul, (x, w), (x, w))
    np.testing.assert_allclose(np.asarray(t), np.asarray(2 * x @ w), rtol=1e-5, atol=1e-4)


def test_build_is_cached_per_source_and_cpu(monkeypatch):
    first = cpu_kernels.build()
    mtime = first.stat().st_mtime_ns
    real_run = cpu_kernels.subprocess.run

    def version_only(cmd, **kw):  # the compiler may be asked its version (part of the key), never to compile
        assert cmd[1:] == ["--version"], f"the cached library was rebuilt: {cmd}"
        return real_run(cmd, **kw)

    monkeypatch.setattr(cpu_kernels.subprocess, "run", version_only)
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime


def test_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("NETRA_JAX_CACHE", str(tmp_path))  # nothing cached there: a build is needed
    monkeypatch.setenv("CXX", str(tmp_path / "broken-cxx"))
    (tmp_path / "broken-cxx").write_text("#!/bin/sh\necho 'broken-cxx: cannot compile' >&2\nexit 1\n")
    (tmp_path / "broken-cxx").chmod(0o755)
    with pytest.raises(RuntimeError, match="broken-cxx: cannot compile"):
        cpu_kernels.build()
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left behind


def test_engine_option_resolution():
    assert EngineConfig().resolved_matmul_backend("cpu") == "cpu_rows_q8"  # the default GGUF: llama.cpp's arithmetic
    tiny = str(FIXTURES / "tiny-llama")  # a Hugging Face checkpoint keeps float activations
    assert EngineConfig(model=tiny).resolved_matmul_backend("cpu") == "cpu_rows"
    assert EngineConfig(matmul_backend="xla").resolved_matmul_backend("cpu") == "xla"
    assert EngineConfig().resolved_matmul_backend("gpu", "9.0") == "gpu"  # the quantized-weight kernels on CUDA
    assert EngineConfig().resolved_matmul_backend("gpu", "8.0") == "gpu_sm80"  # no fp8 tensor cores
    assert EngineConfig(tensor_parallel_size=2).resolved_matmul_backend("cpu") == "xla"
    assert EngineConfig(tensor_parallel_size=2).resolved_matmul_backend("gpu", "9.0") == "xla"
    assert EngineConfig(matmul_backend="gpu_interpret").resolved_matmul_backend("cpu") == "gpu_interpret"
    with pytest.raises(ConfigError, match="'gpu_sm80' needs a GPU"):
        EngineConfig(matmul_backend="gpu_sm80").resolved_matmul_backend("cpu")
    with pytest.raises(ConfigError, match="'gpu' takes whole weights"):
        EngineConfig(matmul_backend="gpu", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="is a CPU kernel"):
        EngineConfig(matmul_backend="cpu_rows").resolved_matmul_backend("gpu")
    with pytest.raises(ConfigError, match="takes whole weights"):
        EngineConfig(matmul_backend="cpu_rows", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="matmul_backend must be one of"):
        EngineConfig(matmul_backend="mkl")


@pytest.fixture(scope="module")
def engines():
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_kv_pages=64)
    model = FIXTURES / "tiny-llama"
    return LLM(model, **kw), LLM(model, matmul_backend="xla", **kw)


def _kernel_rows(llm, tokens: int) -> list[int]:
    """The row count M of each kernel call in the step variant of `tokens` tokens."""
    runner = llm.engine.runner
    text = runner.lower_step(runner.shape_for(tokens)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @netra_small_matmul_f32" in ln]
    return [int(ln.split("(tensor<")[1].split("x")[0]) for ln in calls]


def test_engine_steps_call_the_kernel_where_it_takes_them(engines):
    kernel, xla = engines
    assert kernel.engine.runner.matmul_backend == "cpu_rows" and xla.engine.runner.matmul_backend == "xla"
    # decode rows: the layers are one kernel call each (ops.cpu_decode_layer, its matmuls inside), the lm_head this
    # kernel, one row too
    assert _kernel_rows(kernel, 8) == [8] and _kernel_rows(kernel, 1) == [1]
    # a prefill-sized step: XLA's dot in the layers; only its few sampled rows go through the lm_head kernel
    assert all(m <= cpu_matmul.ROWS_MAX for m in _kernel_rows(kernel, 64)) and len(_kernel_rows(kernel, 64)) <= 1
    assert _kernel_rows(xla, 8) == []


def test_engine_greedy_matches_references_and_xla(engines):
    kernel, xla = engines
    cases = reference("tiny-llama")["cases"]
    rng = np.random.default_rng(3)
    prompts = [c["prompt_ids"] for c in cases] + [rng.integers(3, 500, n).tolist() for n in (5, 17, 40, 9, 60)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, llm in (("kernel", kernel), ("xla", xla)):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[name] = [r.outputs[0].token_ids for r in res]
    assert outs["kernel"] == outs["xla"]
    for c, got in zip(cases, outs["kernel"], strict=False):
        assert got[: len(c["greedy_ids"])] == c["greedy_ids"][: len(got)]


def test_cpu_rows_keeps_xla_for_bfloat16_with_float32_results():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((8, 64), dtype=np.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 40), dtype=np.float32)).astype(jnp.bfloat16)
    got = matmul(x, w, preferred_element_type=jnp.float32, backend="cpu_rows")
    want = matmul(x, w, preferred_element_type=jnp.float32, backend="xla")
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------- int8 weights


@pytest.mark.parametrize("M, K, N", [(1, 576, 1536), (1, 33, 77), *SHAPES])
def test_int8_kernel_matches_float64(M, K, N):
    rng = np.random.default_rng(M * 1000 + N + 7)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.integers(-127, 128, (K, N), dtype=np.int8)
    assert cpu_matmul.takes(jnp.asarray(x), jnp.asarray(w))
    y = np.asarray(jax.jit(cpu_matmul.rows_matmul)(x, w))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.sqrt(K) * np.abs(ref).max() + 1e-30
    assert y.shape == (M, N) and y.dtype == np.float32
    np.testing.assert_array_less(np.abs(y - ref), 1e-6 * scale)
    assert "netra_small_matmul_i8" in jax.jit(cpu_matmul.rows_matmul).lower(x, w).as_text()


def test_int8_other_shapes_run_xla_and_derivative_in_x():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.integers(-127, 128, (40, 24), dtype=np.int8))
    for x in (jnp.ones((33, 40), jnp.float32), jnp.ones((4, 40), jnp.bfloat16)):
        assert not cpu_matmul.takes(x, w)
        assert "netra_small_matmul_i8" not in jax.jit(cpu_matmul.rows_matmul).lower(x, w).as_text()
        np.testing.assert_array_equal(
            np.asarray(cpu_matmul.rows_matmul(x, w)), np.asarray(jnp.dot(x, w.astype(x.dtype)))
        )
    x = jnp.asarray(rng.standard_normal((3, 40), dtype=np.float32))
    c = jnp.asarray(rng.standard_normal((3, 24), dtype=np.float32))  # a linear loss: its gradient is c @ w.T
    got = jax.grad(lambda x: jnp.sum(c * cpu_matmul.rows_matmul(x, w)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(c) @ np.asarray(w, np.float32).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("method, target", [("int8", "netra_small_matmul_i8"), ("fp8", "netra_small_matmul_e4m3")])
@pytest.mark.parametrize("rows", [1, 6])
def test_quantized_matmul_on_the_kernel_equals_xla(rows, method, target):
    """int8 / fp8 weight-only matmul, plain and einsum form: the kernel's (x @ q) * scale against XLA's."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 40), dtype=np.float32))
    for w, spec in (
        (rng.standard_normal((40, 24), dtype=np.float32), None),
        (rng.standard_normal((40, 2, 24), dtype=np.float32), "th,hki->tki"),
    ):
        qw = quantize_weight(jnp.asarray(w), method)
        got = matmul(x, qw, spec, backend="cpu_rows")
        want = matmul(x, qw, spec, backend="xla")
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        text = jax.jit(lambda x, qw, spec=spec: matmul(x, qw, spec, backend="cpu_rows")).lower(x, qw).as_text()
        assert target in text


@pytest.fixture(scope="module")
def int8_engines():
    kw = dict(dtype="float32", quantization="int8", max_num_seqs=8, max_num_batched_tokens=64, num_kv_pages=64)
    model = FIXTURES / "tiny-llama"
    return LLM(model, **kw), LLM(model, matmul_backend="xla", **kw)


def test_int8_engine_steps_call_the_kernel_and_match_xla(int8_engines):
    kernel, xla = int8_engines
    runner = kernel.engine.runner
    text = runner.lower_step(runner.shape_for(1)).as_text()
    assert text.count("custom_call @netra_small_matmul_i8") == 7  # q, k, v, o, gate-up, down and the lm_head
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 17, 40, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [
        [
            r.outputs[0].token_ids
            for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        for llm in (kernel, xla)
    ]
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- fp8 (e4m3fn) weights

E4M3_BITS = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # every pattern but the two NaNs


def random_e4m3(rng, k: int, n: int) -> np.ndarray:
    """[k, n] float8_e4m3fn of random bit patterns (no NaN), every pattern in column 0 when k allows."""
    bits = rng.choice(E4M3_BITS, (k, n))
    m = min(k, len(E4M3_BITS))
    bits[:m, 0] = E4M3_BITS[:m]
    return bits.view(jnp.float8_e4m3fn)


@pytest.mark.parametrize("M, K, N", [(1, 576, 1536), (1, 254, 33), *SHAPES])
def test_e4m3_kernel_matches_float64(M, K, N):
    rng = np.random.default_rng(M * 1000 + N + 11)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = random_e4m3(rng, K, N)
    assert cpu_matmul.takes(jnp.asarray(x), jnp.asarray(w))
    y = np.asarray(jax.jit(cpu_matmul.rows_matmul)(x, w))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.sqrt(K) * np.abs(ref).max() + 1e-30
    assert y.shape == (M, N) and y.dtype == np.float32
    np.testing.assert_array_less(np.abs(y - ref), 1e-6 * scale)
    text = jax.jit(cpu_matmul.rows_matmul).lower(x, w).compile().as_text()
    assert "netra_small_matmul_e4m3" in text and "bitcast-convert" not in text  # the weight is read in place


def test_e4m3_every_bit_pattern_widens_exactly():
    """One-hot rows of x pick single weights: every e4m3 value (subnormals, zeros of both signs, the largest 448)
    comes out as ml_dtypes' float32 of it, in the vector loads (16 columns) and the leftover columns alike."""
    w = np.stack([E4M3_BITS] * 19, axis=1).view(jnp.float8_e4m3fn)  # [254, 19]
    for k0 in range(0, len(E4M3_BITS), 32):
        x = np.eye(len(E4M3_BITS), dtype=np.float32)[k0 : k0 + 32]
        y = np.asarray(cpu_matmul.rows_matmul(jnp.asarray(x), jnp.asarray(w)))
        want = w[k0 : k0 + 32].astype(np.float32)
        np.testing.assert_array_equal(y, want)


@pytest.fixture(scope="module")
def other_e4m3_builds(tmp_path_factory):
    """FFI target per build of cpu_matmul.cc's e4m3 handler for another instruction set: AVX2 + F16C (8-float
    vectors) and portable x86-64 (scalar widening)."""
    if cpu_kernels._compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the other builds are x86-64 instruction sets")
    builds = {"avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"], "portable": ["-march=x86-64", "-mtune=generic"]}
    out = tmp_path_factory.mktemp("matmul_builds")
    source = cpu_kernels.HERE / "cpu_matmul.cc"
    return cpu_kernels.register_builds(source, "NetraSmallMatmulE4M3", "netra_small_matmul_e4m3", builds, out)


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_e4m3_other_builds_match_float64(other_e4m3_builds, build):
    for M, K, N in [(1, 254, 37), (3, 100, 77), (9, 33, 200)]:
        rng = np.random.default_rng(M + N)
        x = rng.standard_normal((M, K), dtype=np.float32)
        w = random_e4m3(rng, K, N)
        call = jax.ffi.ffi_call(other_e4m3_builds[build], jax.ShapeDtypeStruct((M, N), jnp.float32))
        ref = x.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_array_less(np.abs(np.asarray(call(x, w)) - ref), 1e-6 * np.sqrt(K) * np.abs(ref).max())
