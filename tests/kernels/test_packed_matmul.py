"""The Pallas W4A16 / W8A16 kernel (`ops.packed_matmul_triton`), interpreted on CPU, against a float64 numpy product
with the weight de-quantized in numpy and against its jnp reference (`PackedIntWeight.dequantize`): 4 and 8 bits,
groups 32 to 128, zero points and the symmetric form, act-order g_idx, ragged M, K not a multiple of the K step and
partial N tiles, bf16 / f16 / f32 activations; its selection code and its errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax.ops.packed_matmul_triton import (
    PackedMatmulConfig,
    choose_config,
    packed_matmul_reference,
    packed_matmul_triton_interpret,
)
from netra_jax.quant import PackedIntWeight


def _weight(k: int, n: int, bits: int, group: int, zeros: bool, act_order: bool, seed: int):
    """A random PackedIntWeight (float32 scales) and its float64 numpy de-quantization [K, N]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 1 << bits, size=(k, n))  # [K, N] unsigned values
    per = 32 // bits
    packed = np.zeros((k // per, n), np.uint32)
    for j in range(per):  # GPTQ's layout, written out independently of the code under test
        packed |= q[j::per].astype(np.uint32) << np.uint32(bits * j)
    g = rng.permutation(np.arange(k) // group) if act_order else np.arange(k) // group
    scale = rng.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float32)
    zero = rng.integers(0, 1 << bits, size=(k // group, n)) if zeros else np.full((k // group, n), 1 << (bits - 1))
    w = PackedIntWeight(
        packed=jnp.asarray(packed.view(np.int32)),
        scale=jnp.asarray(scale),
        zero=jnp.asarray(zero, jnp.int32) if zeros else None,
        g_idx=jnp.asarray(g, jnp.int32) if act_order else None,
        bits=bits,
        group=group,
        shape=(k, n),
    )
    return w, (q - zero[g]).astype(np.float64) * scale[g].astype(np.float64)


def _run(x, w: PackedIntWeight, **kw):
    return packed_matmul_triton_interpret(x, w.packed, w.scale, w.zero, w.g_idx, bits=w.bits, group=w.group, **kw)


@pytest.mark.parametrize(
    "m,k,n,bits,group,zeros,act_order,config",
    [
        (1, 128, 64, 4, 32, False, False, None),  # one decode row, Q4_0's form
        (5, 96, 80, 4, 32, True, False, PackedMatmulConfig(16, 64, 64)),  # K 1.5 steps, partial N tile
        (33, 256, 48, 4, 128, True, True, None),  # act-order groups of 128, M over two blocks
        (64, 192, 100, 8, 64, False, False, PackedMatmulConfig(32, 32, 128)),  # W8A16, K 1.5 steps, N ragged
        (17, 64, 40, 8, 32, True, True, PackedMatmulConfig(16, 16, 16)),  # K steps shorter than a group
    ],
    ids=["decode_q4", "ragged_k_and_n", "act_order_g128", "w8_prefill", "w8_short_k_steps"],
)
def test_matches_numpy_float32(m, k, n, bits, group, zeros, act_order, config):
    w, want_w = _weight(k, n, bits, group, zeros, act_order, seed=m + k + n)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run(jnp.asarray(x), w, config=config)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ want_w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_its_reference(dtype):
    """Half-precision activations: the weight is rounded to x's dtype before the dot (the kernel's product), the
    reference is float32 throughout, so they agree to that rounding."""
    w, _ = _weight(160, 72, 4, 32, True, False, seed=7)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((9, 160)), dtype)
    got = _run(x, w)
    want = np.asarray(packed_matmul_reference(x, w, jnp.float32))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_out_dtype_float32_from_bf16():
    w, want_w = _weight(64, 32, 8, 64, False, False, seed=3)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64)), jnp.bfloat16)
    got = _run(x, w, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ want_w
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_choose_config():
    assert choose_config(1, 4096, 4096) == PackedMatmulConfig(16, 64, 128)  # decode: more, narrower programs
    assert choose_config(64, 4096, 14336) == PackedMatmulConfig(64, 128, 32)
    assert choose_config(3, 4096, 4096, itemsize=4) == PackedMatmulConfig(16, 64, 32)  # float32 dots on FMA units
    assert choose_config(1, 32, 24) == PackedMatmulConfig(16, 32, 32)  # never wider than the product


def test_bad_arguments_name_the_culprit():
    w, _ = _weight(64, 32, 4, 32, False, False, seed=1)
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bits=3"):
        packed_matmul_triton_interpret(x, w.packed, w.scale, bits=3, group=32)
    with pytest.raises(ValueError, match=r"packed \(8, 32\)"):
        packed_matmul_triton_interpret(jnp.zeros((2, 128)), w.packed, w.scale, bits=4, group=32)
    with pytest.raises(ValueError, match="scale"):
        packed_matmul_triton_interpret(x, w.packed, w.scale, bits=4, group=64)
