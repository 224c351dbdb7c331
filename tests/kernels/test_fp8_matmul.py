"""The FP8 W8A8 path (`ops.fp8_matmul`) on CPU against a numpy emulation of its rounding: e4m3 round-to-nearest-even
written out from the format's definition (3 mantissa bits, exponent bias 7, subnormals below 2^-6, largest 448), the
per-row activation scales, and the product in float64."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax.ops.fp8_matmul import fp8_matmul, fp8_matmul_reference, has_fp8, quantize_rows_e4m3


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """float64 values rounded to the nearest float8_e4m3fn value (ties to even), |v| <= 448."""
    a = np.abs(v)
    exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = 2.0 ** (np.maximum(exp, -6) - 3)  # 8 steps per binade; subnormals share 2^-9
    return np.sign(v) * np.round(a / quantum) * quantum  # np.round: half to even


def row_scales(x: np.ndarray) -> np.ndarray:
    """Each row's absolute maximum over 448 (1 for a zero row), [M, 1]."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    return np.where(amax > 0, amax / 448.0, 1.0)


def emulate(x: np.ndarray, sx: np.ndarray, q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x's rows as the fp8 dot sees them, the W8A8 product) in float64, for row scales sx [M, 1] (the path's own
    float32 scales: the last bit of amax / 448 is XLA's, the rounding under test is e4m3's)."""
    xq = e4m3_round(np.clip(x.astype(np.float32) / sx.astype(np.float32), -448, 448).astype(np.float64))
    return xq * sx, (xq @ q.astype(np.float64)) * sx * scale.astype(np.float64)


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)) * np.array([[1.0], [1e-3], [40.0], [0.0], [1.0]])  # a zero row too
    x[4, :8] = [448.0, -3.0, 2.0**-9, 2.0**-8 * 1.5, 0.1, 200.0, -0.0, 5.0]  # subnormal and tie cases after scaling
    x = x.astype(np.float32)
    q = jnp.asarray(rng.uniform(-448, 448, (96, 40)), jnp.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.01, 40).astype(np.float32)
    return x, q, scale


def test_the_rounding_is_e4m3_round_to_nearest_even():
    v = np.array([0.0, 2.0**-10, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 1.0625, 1.1875, 17.0, 448.0, -3.3])
    got = np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(e4m3_round(v), got)  # the emulation is the format's rounding


def test_rows_quantize_to_the_emulated_values(case):
    x, _, _ = case
    qx, sx = quantize_rows_e4m3(jnp.asarray(x))
    sx = np.asarray(sx, np.float64)
    assert qx.dtype == jnp.float8_e4m3fn and sx.shape == (5, 1)
    np.testing.assert_allclose(sx, row_scales(x.astype(np.float64)), rtol=1e-6)
    want, _ = emulate(x, sx, np.zeros((96, 1)), np.zeros(1))
    np.testing.assert_array_equal(np.asarray(qx, np.float64) * sx, want)


def test_w8a8_product_equals_the_numpy_emulation(case):
    x, q, scale = case
    _, sx = quantize_rows_e4m3(jnp.asarray(x))
    _, want = emulate(x, np.asarray(sx, np.float64), np.asarray(q, np.float64), scale)
    got = fp8_matmul(jnp.asarray(x), q, jnp.asarray(scale), jnp.float32)
    assert got.shape == (5, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    ref = fp8_matmul_reference(jnp.asarray(x), q, jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_bf16_activations_give_bf16():
    x = jnp.ones((2, 32), jnp.bfloat16)
    q = jnp.ones((32, 8), jnp.float8_e4m3fn)
    y = fp8_matmul(x, q, jnp.full((8,), 0.5, jnp.float32))
    assert y.dtype == jnp.bfloat16 and np.all(np.asarray(y, np.float32) == 16.0)


def test_bad_weight_is_refused():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(jnp.ones((2, 32)), jnp.ones((32, 8), jnp.int8), jnp.ones(8))


def test_fp8_capable_gpus():
    assert has_fp8("9.0") and has_fp8("8.9") and has_fp8("10.0")
    assert not has_fp8("8.0") and not has_fp8("8.6") and not has_fp8(None)
