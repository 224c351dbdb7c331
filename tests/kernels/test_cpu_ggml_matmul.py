"""The CPU matmul against GGML-block weights (netra_jax/ops/cpu_ggml_matmul.cc) for every type it takes, against
float64 numpy of `gguf.quants.dequantize` (the ground truth of the block layouts): ragged shapes over its paths (one
row; one register tile; several with carried partial sums; partial weight tiles; K not a whole number of its steps),
random bytes (every bit pattern) and gguf-quantized blocks, its other instruction sets' builds next to the native
one, its refusals, vmap and the derivative in x; Q4_K and Q6_K with their rows interleaved by 16 (Q4_K_X16,
Q6_K_X16) on int8 activations, against the same float64 of the rows as stored.

The int8-activation path twice: against float64 of x quantized as documented (then only float rounding differs),
and against the exact product within the bound that the activations' rounding implies."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.gguf_blocks import int8_rounded

from netra_jax.ops import cpu_ggml_matmul, cpu_kernels
from netra_jax.ops.cpu_ggml_matmul import INT8_TYPES, TYPES, blocks_matmul, takes
from netra_jax.ops.ggml_blocks import FORMATS, interleave_rows

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the kernel")

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants quantizes these; the K-quants it only reads
# byte offsets of each type's fp16 scale fields in its block (d, and dmin / m)
HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}
HALVES["Q6_K"] = (208,)

# (M, blocks per row, N): one row (a stream per weight row), 2-3 rows (one register tile), more (tiles of carried
# partial sums, ragged heights); N of partial weight tiles, 1, and many; K of one block, of steps and part steps
# (32-value types: 8 blocks a step; K-quants: 1)
SHAPES = [
    (1, 1, 1),
    (1, 3, 7),
    (1, 21, 4100),
    (2, 8, 33),
    (3, 5, 17),
    (4, 2, 16),
    (5, 9, 4100),
    (7, 1, 9),
    (8, 4, 64),
    (9, 3, 25),
    (13, 10, 41),
    (32, 2, 19),
    (64, 3, 24),
    (37, 1, 3),
    (128, 2, 13),
]
# the int8 path's rows past the float path's 128 (prefill chunks): groups of 16 rows in the lanes, the last partial
INT8_SHAPES = [*SHAPES, (17, 2, 9), (200, 3, 21), (300, 9, 5)]


def random_blocks(rng, qtype: str, n: int, blocks: int) -> np.ndarray:
    """uint8 [n, blocks * block_bytes]: random bytes, the fp16 scale fields set in [1e-3, 1e-2] (random halves
    would include infinities and NaNs)."""
    block_bytes = FORMATS[qtype].block_bytes
    w = rng.integers(0, 256, (n, blocks, block_bytes), dtype=np.uint8)
    for at in HALVES[qtype]:
        d = rng.uniform(1e-3, 1e-2, (n, blocks)).astype(np.float16)
        w[..., at : at + 2] = d.view(np.uint8).reshape(n, blocks, 2)
    return w.reshape(n, -1)


def quantized_blocks(rng, qtype: str, n: int, blocks: int) -> np.ndarray:
    qk = FORMATS[qtype].qk
    return gguf.quants.quantize(
        rng.standard_normal((n, blocks * qk), dtype=np.float32), gguf.GGMLQuantizationType[qtype]
    )


def reference(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    dense = gguf.quants.dequantize(w, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    return x.astype(np.float64) @ dense.T


def assert_close(y, ref, k: int) -> None:
    """float32 accumulation of k products against float64: a few ulps of the result's magnitude times sqrt(k); a
    misplaced bit, nibble or scale is off by about the size of a product."""
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32
    scale = np.sqrt(k) * np.abs(ref).max() + 1e-30
    np.testing.assert_array_less(np.abs(y - ref), 1e-6 * scale)


def rounding_bound(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """[M, N] bound on |int8 path - exact product|: x's rounding moves each value by at most d / 2 = max|x| / 254 of
    its block (32 values, 256 against the K-quants), so the product moves by at most sum over blocks of 32 of
    max|x| / 254 * sum |w| (1e-4 more for the float32 arithmetic of x * (127 / max|x|))."""
    dense = np.abs(gguf.quants.dequantize(w, gguf.GGMLQuantizationType[qtype]).astype(np.float64))
    m, k = x.shape
    size = 256 if qtype.endswith("_K") else 32
    amax = np.abs(x.astype(np.float64)).reshape(m, k // size, size).max(-1)  # [M, blocks of x]
    amax = np.repeat(amax, size // 32, axis=1)  # [M, blocks of 32]
    w_sums = dense.reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, blocks]
    return (amax / 254) @ w_sums.T * (1 + 1e-4)


@functools.cache
def _jitted(qtype: str, int8_x: bool = False):
    return jax.jit(functools.partial(blocks_matmul, qtype=qtype, int8_x=int8_x))


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("M, blocks, N", SHAPES)
def test_matches_float64(qtype, M, blocks, N):
    rng = np.random.default_rng(M * 1000 + blocks * 10 + N)
    k = blocks * FORMATS[qtype].qk
    w = random_blocks(rng, qtype, N, blocks)
    x = rng.standard_normal((M, k), dtype=np.float32)
    assert takes(jnp.asarray(x), jnp.asarray(w), qtype)
    assert_close(_jitted(qtype, False)(x, w), reference(x, w, qtype), k)


@pytest.mark.parametrize("qtype", [t for t in INT8_TYPES if t in TYPES])  # the GGUF types (interleaved: below)
@pytest.mark.parametrize("M, blocks, N", INT8_SHAPES)
def test_int8_x_matches_float64_of_int8_rounded(qtype, M, blocks, N):
    rng = np.random.default_rng(M * 1000 + blocks * 10 + N + 1)
    w = random_blocks(rng, qtype, N, blocks)
    k = blocks * FORMATS[qtype].qk  # the K-quants: 8 blocks of x a weight block
    x = rng.standard_normal((M, k), dtype=np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    y = _jitted(qtype, True)(x, w)
    assert_close(y, reference(int8_rounded(x, qtype), w, qtype), k)
    error = np.abs(np.asarray(y, np.float64) - reference(x, w, qtype))
    bound = rounding_bound(x, w, qtype) + 1e-6 * np.sqrt(k) * np.abs(reference(x, w, qtype)).max()
    assert np.all(error <= bound), f"error over the bound by {(error - bound).max():.3g}"


needs_interleaved = pytest.mark.skipif(
    cpu_kernels.interleaved_rows() != 16, reason="this build reads no interleaved layout (AVX-512 VNNI)"
)
# (M, blocks per row, N): N in whole groups of 16 rows; one row of x, register tiles of 2-4, ragged tiles, a prefill
# chunk split into two calls (600 rows)
X16_SHAPES = [(1, 1, 16), (1, 3, 48), (2, 8, 32), (3, 5, 16), (4, 2, 64), (5, 9, 32), (9, 3, 16), (13, 2, 48)]
X16_SHAPES += [(64, 1, 32), (600, 2, 16)]


@needs_interleaved
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("M, blocks, N", X16_SHAPES)
def test_interleaved_rows_match_float64_of_int8_rounded(qtype, M, blocks, N):
    rng = np.random.default_rng(M * 1000 + blocks * 10 + N + 2)
    w = random_blocks(rng, qtype, N, blocks)
    k = blocks * 256
    x = rng.standard_normal((M, k), dtype=np.float32)
    x[0, :256] = 0.0  # an all-zero block of x: d = 0
    x16, name = interleave_rows(jnp.asarray(w), qtype)
    assert name == f"{qtype}_X16" and x16.shape == w.shape
    assert takes(jnp.asarray(x), x16, name, int8_x=True)
    assert_close(_jitted(name, True)(x, x16), reference(int8_rounded(x, qtype), w, qtype), k)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_libraries_interleave_equals_the_jnp_layout(qtype):
    """The loader's re-lay (C++, `cpu_kernels.interleave`) writes exactly `ggml_blocks.interleave_rows`' bytes."""
    rng = np.random.default_rng(7)
    w = rng.integers(0, 256, (2, 48, 3 * FORMATS[qtype].block_bytes), dtype=np.uint8)  # gate / up style: 2 x 48
    np.testing.assert_array_equal(
        cpu_kernels.interleave(w, qtype), np.asarray(interleave_rows(jnp.asarray(w), qtype)[0])
    )
    with pytest.raises(ValueError, match="whole groups of 16"):
        cpu_kernels.interleave(w[:, :40], qtype)
    with pytest.raises(ValueError, match="Q4_K or Q6_K"):
        cpu_kernels.interleave(w, "Q4_0")


def test_interleaved_layout_refusals():
    x = jnp.ones((2, 256), jnp.float32)
    w = jnp.zeros((32, 144), jnp.uint8)
    with pytest.raises(ValueError, match="int8 activations only"):
        blocks_matmul(x, w, "Q4_K_X16")
    with pytest.raises(ValueError, match="groups of 16 rows, w has 40"):
        blocks_matmul(x, jnp.zeros((40, 144), jnp.uint8), "Q4_K_X16", int8_x=True)
    call = jax.ffi.ffi_call(cpu_ggml_matmul.TARGET, jax.ShapeDtypeStruct((2, 40), jnp.float32))
    with pytest.raises(Exception, match="groups of 16 rows"):  # the kernel checks it too
        jax.block_until_ready(call(x, jnp.zeros((40, 144), jnp.uint8), qtype=np.int32(1012), int8_x=np.int32(1)))
    with pytest.raises(Exception, match="no float32-activation path"):
        jax.block_until_ready(call(x, jnp.zeros((40, 144), jnp.uint8), qtype=np.int32(1012), int8_x=np.int32(0)))


@pytest.mark.parametrize("qtype", QUANTIZABLE)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("int8_x", [False, True])
def test_gguf_quantized_blocks(qtype, M, int8_x):
    rng = np.random.default_rng(M)
    w = quantized_blocks(rng, qtype, 45, 11)
    x = rng.standard_normal((M, 11 * 32), dtype=np.float32) * rng.uniform(0.1, 10, (M, 1)).astype(np.float32)
    assert_close(_jitted(qtype, int8_x)(x, w), reference(int8_rounded(x, qtype) if int8_x else x, w, qtype), 11 * 32)


@pytest.mark.parametrize("M", [2, 9, 200])
def test_float_x_is_the_default_and_int8_takes_prefill_rows(M):
    rng = np.random.default_rng(M)
    w, w_k = random_blocks(rng, "Q4_0", 16, 8), random_blocks(rng, "Q6_K", 16, 1)
    x = rng.standard_normal((M, 256), dtype=np.float32)
    assert takes(jnp.asarray(x), jnp.asarray(w), "Q4_0") == (M <= 128)
    assert takes(jnp.asarray(x), jnp.asarray(w), "Q4_0", int8_x=True)
    if M <= 128:
        assert_close(jax.jit(lambda x, w: blocks_matmul(x, w, "Q4_0"))(x, w), reference(x, w, "Q4_0"), 256)
    # Q6_K's int8 path (16-value scales) takes any number of rows: up to 16 in tiles of 4, more in the lanes
    assert takes(jnp.asarray(x), jnp.asarray(w_k), "Q6_K", int8_x=True)
    y = jax.jit(lambda x, w: blocks_matmul(x, w, "Q6_K", int8_x=True))(x, w_k)
    assert_close(y, reference(int8_rounded(x, "Q6_K"), w_k, "Q6_K"), 256)


@pytest.mark.parametrize("M", [513, 1100])
def test_int8_x_past_a_call_is_split_into_equal_calls(M):
    """Rows past INT8_CHUNK_ROWS run as equal kernel calls (1100: 367 + 367 + 366), each row as it would alone."""
    rng = np.random.default_rng(M)
    w = random_blocks(rng, "Q4_0", 9, 2)
    x = rng.standard_normal((M, 64), dtype=np.float32)
    calls = [e for e in _jitted("Q4_0", True).lower(x, w).as_text().splitlines() if cpu_ggml_matmul.TARGET in e]
    assert len(calls) == -(-M // cpu_ggml_matmul.INT8_CHUNK_ROWS)
    assert_close(_jitted("Q4_0", True)(x, w), reference(int8_rounded(x, "Q4_0"), w, "Q4_0"), 64)


def test_lowers_to_the_kernel_and_vmaps():
    rng = np.random.default_rng(7)
    w = random_blocks(rng, "Q4_K", 12, 2)
    x = rng.standard_normal((3, 4, 512), dtype=np.float32)
    assert cpu_ggml_matmul.TARGET in _jitted("Q4_K").lower(x[0], w).as_text()
    got = jax.vmap(lambda xb: blocks_matmul(xb, w, "Q4_K"))(x)
    assert_close(got, np.stack([reference(xb, w, "Q4_K") for xb in x]), 512)


def test_derivative_in_x():
    rng = np.random.default_rng(8)
    w = random_blocks(rng, "Q5_1", 24, 3)
    x = jnp.asarray(rng.standard_normal((5, 96), dtype=np.float32))
    c = rng.standard_normal((5, 24), dtype=np.float32)
    dense = gguf.quants.dequantize(w, gguf.GGMLQuantizationType.Q5_1).astype(np.float64)
    got = jax.grad(lambda x: jnp.sum(c * blocks_matmul(x, w, "Q5_1")))(x)  # a linear loss: its gradient is c @ W
    assert_close(got, c.astype(np.float64) @ dense, 24)
    dx = rng.standard_normal((5, 96), dtype=np.float32)
    _, tangent = jax.jvp(lambda x: blocks_matmul(x, w, "Q5_1"), (x,), (jnp.asarray(dx),))
    assert_close(tangent, dx.astype(np.float64) @ dense.T, 96)


@pytest.mark.parametrize(
    "x, w, qtype, why",
    [
        (np.ones((2, 64), np.float32), np.ones((3, 36), np.uint8), "Q2_K", "is not one of"),
        (np.ones((2, 64), np.float32), np.ones((3, 37), np.uint8), "Q4_0", "w's are 37"),
        (np.ones((2, 64), np.float32), np.ones((3, 54), np.uint8), "Q4_0", "w's are 54"),
        (np.ones((2, 64), np.float16), np.ones((3, 36), np.uint8), "Q4_0", "x must be float32"),
        (np.ones((2, 64), np.float32), np.ones((3, 36), np.int8), "Q4_0", "w must be uint8"),
        (np.ones((64,), np.float32), np.ones((3, 36), np.uint8), "Q4_0", "x must be float32 \\[M, K\\]"),
        (np.ones((129, 256), np.float32), np.ones((3, 144), np.uint8), "Q4_K", "takes 1 to 128 with float x"),
        (np.ones((129, 64), np.float32), np.ones((3, 36), np.uint8), "Q4_0", "takes 1 to 128 with float x"),
        (np.ones((0, 64), np.float32), np.ones((3, 36), np.uint8), "Q4_0", "has 0 rows"),
    ],
)
def test_refuses_what_it_does_not_take(x, w, qtype, why):
    assert not takes(jnp.asarray(x), jnp.asarray(w), qtype)
    with pytest.raises(ValueError, match=why):
        blocks_matmul(jnp.asarray(x), jnp.asarray(w), qtype)


def test_the_kernel_checks_its_operands():
    call = jax.ffi.ffi_call(cpu_ggml_matmul.TARGET, jax.ShapeDtypeStruct((2, 3), jnp.float32), vmap_method="sequential")
    x, w = jnp.ones((2, 64), jnp.float32), jnp.ones((3, 38), jnp.uint8)
    with pytest.raises(Exception, match="w's rows of 38 bytes are not K = 64 values"):
        jax.block_until_ready(call(x, w, qtype=np.int32(2), int8_x=np.int32(0)))
    with pytest.raises(Exception, match="GGML type 10 is not one of"):
        jax.block_until_ready(call(x, jnp.ones((3, 36), jnp.uint8), qtype=np.int32(10), int8_x=np.int32(0)))


# ---------------------------------------------------------------- the other instruction sets' builds

AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"]
BUILDS = {
    "avx2": [*AVX2, "-mno-avxvnni"],  # 8-float vectors, fifth bits by shifts; int8 dot products by maddubs
    "avx2_vnni": [*AVX2, "-mavxvnni"],  # int8 dot products by AVX-VNNI
    "avx512_no_vnni": [*AVX2[:-1], "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mno-avx512vnni"],
    "portable": ["-march=x86-64", "-mtune=generic"],  # 4-float generic vectors, scalar widening and fp16 conversion
}
# what each build executes, as /proc/cpuinfo names it: a build this CPU cannot run is skipped (it would die of an
# illegal instruction, taking the test process with it)
NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx2_vnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512_no_vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "portable": set(),
}


def _host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")), "").split())


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory):
    """FFI target name per build of cpu_ggml_matmul.cc for another instruction set, compiled in parallel."""
    if cpu_kernels._compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the other builds are x86-64 instruction sets")
    out = tmp_path_factory.mktemp("ggml_builds")
    source = cpu_kernels.HERE / "cpu_ggml_matmul.cc"
    return cpu_kernels.register_builds(source, "NetraGgmlMatmulF32", cpu_ggml_matmul.TARGET, BUILDS, out)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("qtype", list(TYPES))
def test_other_builds_match_float64(other_builds, build, qtype):
    missing = NEEDS[build] - _host_flags()
    if missing:
        pytest.skip(f"this CPU cannot run the {build} build (no {', '.join(sorted(missing))})")
    for M, blocks, N in [(1, 3, 7), (2, 9, 13), (5, 2, 20), (9, 1, 11), (1, 17, 5)]:
        rng = np.random.default_rng(M + N)
        k = blocks * FORMATS[qtype].qk
        w = random_blocks(rng, qtype, N, blocks)
        x = rng.standard_normal((M, k), dtype=np.float32)
        call = jax.ffi.ffi_call(
            other_builds[build], jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential"
        )
        ggml_type = np.int32(FORMATS[qtype].ggml_type)
        assert_close(call(x, w, qtype=ggml_type, int8_x=np.int32(0)), reference(x, w, qtype), k)
        if qtype in INT8_TYPES:
            assert_close(
                call(x, w, qtype=ggml_type, int8_x=np.int32(1)), reference(int8_rounded(x, qtype), w, qtype), k
            )
