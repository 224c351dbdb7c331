"""Pallas (Triton lowering) grouped matmul for the mixture-of-experts MLPs on GPUs: rows sorted by group (expert),
each multiplied by its group's matrix, reading each used group's matrix once per row block and no other group's.

On GPU XLA expands `jax.lax.ragged_dot` into a masked product of every row with every group's matrix: a Qwen3-30B-A3B
layer at 2048 tokens needed 8 GiB of temporaries for it and 128 times the FLOPs, and a decode step read all 128
experts' weights (the GPU compile check, benchmarks/gpu_compile, found it). This kernel computes only the pairs of a
row and its own group. Its reference is `jax.lax.ragged_dot`.

Layout: the R rows are cut into blocks of BM rows of one group (`attention_blocks.block_layout` over the group
offsets, as the attention kernels cut a ragged token batch): R // BM + G blocks cover any grouping, idle blocks
exit at once. Grid = (blocks, N // BN); each program accumulates its [BM, BN] tile in float32 over K in BK steps."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from netra_jax.ops.attention_blocks import block_layout
from netra_jax.ops.gpu_budget import GpuBudget

_SMEM_BUDGET = 160 * 1024
GPU_BUDGET = GpuBudget(registers=255, smem_bytes=_SMEM_BUDGET)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static launch configuration; every size a power of two >= 16 (Triton's)."""

    block_m: int  # rows per block (all of one group)
    block_n: int  # output columns per program
    block_k: int  # contraction step
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < (1 if name == "num_warps" else 16) or v & (v - 1):
                raise ValueError(f"GroupedMatmulConfig.{name}={v} must be a power of two (>= 16)")


def choose_config(num_rows: int, num_groups: int, k: int, n: int, itemsize: int = 2) -> GroupedMatmulConfig:
    """Row blocks of about a group's even share of the rows (16 for decode steps, where each expert has a few rows,
    up to 64 for prefill), 128-wide column tiles (64 for float32, whose dots run on FMA units, and for 16-row
    blocks: a [16, 128] bf16 tile spilled on sm_90a, GPU compile check) and 64-deep K steps (32 for float32)."""
    share = -(-num_rows // max(1, num_groups))
    block_m = min(64, max(16, 1 << max(0, share - 1).bit_length()))
    bf16 = itemsize <= 2
    block_n = min(128 if bf16 and block_m > 16 else 64, max(16, 1 << max(0, n - 1).bit_length()))
    block_k = min(64 if bf16 else 32, max(16, 1 << max(0, k - 1).bit_length()))
    return GroupedMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k)


def _kernel(group_ref, start_ref, count_ref, x_ref, w_ref, o_ref, *, cfg: GroupedMatmulConfig, group_axis: int):
    """One [BM, BN] output tile: rows [start, start + count) of the block's group times columns j * BN onwards of
    the group's matrix. group_ref, start_ref, count_ref: [NB] int32; x_ref: [R, K]; w_ref: [G, K, N] (group_axis
    0) or [K, G, N] (1); o_ref: [R + BM, cdiv(N, BN) * BN], padded so that every lane of a store has its own
    in-bounds address (the interpreter turns masked stores into read-modify-write scatters, which would race on
    shared addresses)."""
    b, j = pl.program_id(0), pl.program_id(1)
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    R, K = x_ref.shape
    N = w_ref.shape[2]
    count = count_ref[b]

    @pl.when(count > 0)
    def _():
        g, start = group_ref[b], start_ref[b]
        r = jnp.arange(BM, dtype=jnp.int32)
        row_ok = r < count  # [BM]
        rows = jnp.minimum(start + r, R - 1)  # clamped for the masked rows' addresses
        cols = j * BN + jnp.arange(BN, dtype=jnp.int32)  # in range of the padded output
        col_ok = cols < N
        cols_c = jnp.minimum(cols, N - 1)  # for the loads of w
        prec = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

        def step(kk, acc):
            ks = kk * BK + jnp.arange(BK, dtype=jnp.int32)
            k_ok = ks < K
            ks_c = jnp.minimum(ks, K - 1)
            x = plgpu.load(x_ref.at[rows[:, None], ks_c[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
            at = (g, ks_c[:, None]) if group_axis == 0 else (ks_c[:, None], g)
            w = plgpu.load(w_ref.at[*at, cols_c[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
            return acc + plgpu.dot(x, w.astype(x.dtype), precision=prec)  # [BM, BN] f32

        acc = lax.fori_loop(0, pl.cdiv(K, BK), step, jnp.zeros((BM, BN), jnp.float32))
        out_rows = start + r  # < R + BM: the padded output's rows
        plgpu.store(o_ref.at[out_rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=row_ok[:, None])


def grouped_matmul_triton(
    rows: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
    group_axis: int = 0,
) -> jax.Array:
    """rows [R, K] sorted by group, w [G, K, N], group_sizes [G] int -> [R, N] in rows' dtype: row i times its
    group's matrix, accumulated in float32 (float32 inputs at full precision); rows past sum(group_sizes) are zeros,
    as `jax.lax.ragged_dot` gives. group_axis=1: w is [K, G, N] (LoRA's shrink factors, `ops.lora_segment`), read
    in place rather than transposed by a copy of every group."""
    R, K = rows.shape
    if group_axis not in (0, 1):
        raise ValueError(f"grouped matmul group_axis must be 0 ([G, K, N]) or 1 ([K, G, N]), got {group_axis}")
    K2, G, N = w.shape if group_axis == 1 else (w.shape[1], w.shape[0], w.shape[2])
    if K2 != K or group_sizes.shape != (G,):
        raise ValueError(f"grouped matmul shapes: rows {rows.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
    if config is None:
        config = choose_config(R, G, K, N, jnp.dtype(rows.dtype).itemsize)
    config.validate()
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])  # [G + 1]
    group, start, count, _ = block_layout(offsets, sizes, R, config.block_m)  # [NB] each
    nb = group.shape[0]
    n_tiles = pl.cdiv(N, config.block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=config, group_axis=group_axis),
        grid=(nb, n_tiles),
        out_shape=jax.ShapeDtypeStruct((R + config.block_m, n_tiles * config.block_n), rows.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"grouped_matmul_m{config.block_m}_n{config.block_n}_k{config.block_k}",
    )(group, start, count, rows, w)
    covered = jnp.arange(R, dtype=jnp.int32) < offsets[-1]  # rows of no group were never written
    return jnp.where(covered[:, None], out[:R, :N], 0)


def grouped_matmul_triton_interpret(rows, w, group_sizes, **kw) -> jax.Array:
    """The same kernel run by the Pallas interpreter (CPU tests)."""
    return grouped_matmul_triton(rows, w, group_sizes, interpret=True, **kw)


def grouped_matmul_reference(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The plain-jnp contract: `jax.lax.ragged_dot` with a float32 accumulator, in rows' dtype."""
    out = lax.ragged_dot(rows, w.astype(rows.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


__all__ = [
    "GPU_BUDGET",
    "GroupedMatmulConfig",
    "choose_config",
    "grouped_matmul_reference",
    "grouped_matmul_triton",
    "grouped_matmul_triton_interpret",
]
