"""The Pallas grouped-matmul kernel (the experts of MoE models on CUDA), interpreted on CPU, against a float64 numpy
product of each row with its own group's matrix and against its reference (`jax.lax.ragged_dot`): empty and uneven
groups, rows past the groups, ragged K and N tiles, bf16 and float32, and its selection code."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax.ops.grouped_matmul_triton import (
    GroupedMatmulConfig,
    choose_config,
    grouped_matmul_reference,
    grouped_matmul_triton_interpret,
)


def _case(rows: int, groups: int, k: int, n: int, seed: int, covered: int | None = None):
    rng = np.random.default_rng(seed)
    covered = rows if covered is None else covered
    sizes = np.bincount(rng.integers(0, groups, covered), minlength=groups).astype(np.int32)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    w = rng.normal(size=(groups, k, n)).astype(np.float32)
    group = np.repeat(np.arange(groups), sizes)
    want = np.zeros((rows, n))
    want[:covered] = np.einsum("rk,rkn->rn", x[:covered].astype(np.float64), w[group].astype(np.float64))
    return x, w, sizes, want


@pytest.mark.parametrize(
    "rows,groups,k,n",
    [(1, 8, 64, 64), (8, 16, 64, 96), (37, 5, 40, 50), (130, 4, 64, 128)],
    ids=["one_row", "decode_most_groups_empty", "ragged_k_and_n", "prefill_blocks"],
)
def test_matches_numpy_float32(rows, groups, k, n):
    x, w, sizes, want = _case(rows, groups, k, n, seed=rows)
    got = grouped_matmul_triton_interpret(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_bf16_matches_its_reference():
    x, w, sizes, _ = _case(70, 6, 48, 80, seed=3)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes))
    got = np.asarray(grouped_matmul_triton_interpret(*args), np.float32)
    want = np.asarray(grouped_matmul_reference(*args), np.float32)
    assert grouped_matmul_triton_interpret(*args).dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_rows_past_the_groups_are_zero():
    """ragged_dot's contract: rows beyond sum(group_sizes) belong to no group and come out zero."""
    x, w, sizes, want = _case(20, 3, 16, 32, seed=5, covered=13)
    got = np.asarray(grouped_matmul_triton_interpret(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    assert not got[13:].any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_explicit_configuration():
    """Several row blocks per group and several K steps per tile (small blocks), same numbers."""
    x, w, sizes, want = _case(50, 3, 80, 40, seed=7)
    cfg = GroupedMatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=2)
    got = grouped_matmul_triton_interpret(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), config=cfg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        GroupedMatmulConfig(block_m=24, block_n=16, block_k=16).validate()
    with pytest.raises(ValueError, match="shapes"):
        grouped_matmul_triton_interpret(jnp.asarray(x), jnp.asarray(w[:, :8]), jnp.asarray(sizes))


def test_selection():
    """Decode steps (a few rows per expert) get 16-row blocks with 64-wide tiles, prefill 64-row blocks with
    128-wide ones; float32 halves the tiles."""
    assert choose_config(8, 128, 2048, 1536) == GroupedMatmulConfig(block_m=16, block_n=64, block_k=64)
    assert choose_config(16384, 128, 2048, 1536) == GroupedMatmulConfig(block_m=64, block_n=128, block_k=64)
    assert choose_config(16384, 128, 2048, 1536, itemsize=4) == GroupedMatmulConfig(64, 64, 32)
    assert choose_config(3, 8, 8, 8) == GroupedMatmulConfig(block_m=16, block_n=16, block_k=16)
