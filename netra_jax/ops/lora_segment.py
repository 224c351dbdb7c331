"""Multi-LoRA deltas as segment matmuls on GPUs (SGMV): tokens sorted by adapter slot, each slot's rows multiplied by
that slot's factors only, on the Pallas grouped-matmul kernel of the MoE experts (`ops.grouped_matmul_triton`).

`models.lora.lora_delta`'s reference multiplies every token by all S slots' factors and masks the other slots'
columns (S times one adapter's cost, every slot's factors read). Here the T tokens are sorted by slot (stable), the
tokens without an adapter (slot -1) last, past the groups, so the kernel neither reads a matrix for them nor writes
them (they come out zero, as ragged_dot's rows past its groups); then two grouped matmuls, shrink
x_sorted [T, in] @ a[:, slot] -> [T, Rg] (the [in, S, Rg] factors read in place: `group_axis=1`) and expand
[T, Rg] @ b[slot] -> [T, out], and the rows are put back in token order. Every shape is static (T, S, Rg, in, out):
one program for every mix of adapters, ranks below the slots' and tokens without adapters. A token's delta depends
on its own row and slot only (a row block holds one slot; each output element is accumulated over K in the same
order wherever its row sits), so it does not change with its neighbours' slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops.grouped_matmul_triton import GroupedMatmulConfig, choose_config, grouped_matmul_triton

__all__ = ["lora_segment_delta", "lora_segment_delta_interpret", "segment_configs", "sort_by_slot"]


def sort_by_slot(slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """slots [T] int (-1, or anything outside [0, num_slots): no adapter) -> (order [T] int32: the tokens sorted
    by slot, stable, those without an adapter last; group_sizes [num_slots] int32: tokens per slot)."""
    key = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots).astype(jnp.int32)  # [T], none -> S
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # [T]
    sizes = jnp.sum(key[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)
    return order, sizes  # sizes: [S], summing to the tokens with an adapter


def segment_configs(
    num_tokens: int, num_slots: int, fan_in: int, group_rank: int, fan_out: int, dtype
) -> tuple[GroupedMatmulConfig, GroupedMatmulConfig]:
    """The grouped kernel's launch configurations of the shrink ([T, in] @ [in, Rg] per slot) and expand ([T, Rg]
    @ [Rg, out]) products: `grouped_matmul_triton.choose_config`'s, which rounds the narrow side (Rg of 16-192)
    up to a power-of-two tile of at least 16, the rest masked."""
    itemsize = jnp.dtype(dtype).itemsize
    return (
        choose_config(num_tokens, num_slots, fan_in, group_rank, itemsize),
        choose_config(num_tokens, num_slots, group_rank, fan_out, itemsize),
    )


def lora_segment_delta(
    x: jax.Array,
    group: tuple[jax.Array, jax.Array],
    slots: jax.Array,
    *,
    interpret: bool = False,
    configs: tuple[GroupedMatmulConfig, GroupedMatmulConfig] | None = None,
) -> jax.Array:
    """Each token's adapter delta on the grouped kernel: x [T, in], group = (a [in, S, Rg], b [S, Rg, out]), slots
    [T] int (-1: none) -> [T, out] in x's dtype, what `models.lora.lora_delta`'s reference gives (the factors cast
    to x's dtype tile by tile, float32 accumulation, the [T, Rg] intermediate rounded to x's dtype in between).
    interpret: run the kernel in the Pallas interpreter (CPU tests); configs: the (shrink, expand) launch
    configurations (default `segment_configs`)."""
    a, b = group
    T, fan_in = x.shape
    fan_in_a, num_slots, group_rank = a.shape
    if fan_in_a != fan_in or b.shape[:2] != (num_slots, group_rank) or slots.shape != (T,):
        raise ValueError(f"LoRA segment shapes: x {x.shape}, a {a.shape}, b {b.shape}, slots {slots.shape}")
    fan_out = b.shape[2]
    if configs is None:
        configs = segment_configs(T, num_slots, fan_in, group_rank, fan_out, x.dtype)
    shrink_cfg, expand_cfg = configs
    order, sizes = sort_by_slot(slots, num_slots)  # [T], [S]
    xs = x[order]  # [T, in], by slot; tokens without an adapter last (past the groups: never read)
    xa = grouped_matmul_triton(xs, a, sizes, config=shrink_cfg, interpret=interpret, group_axis=1)  # [T, Rg]
    ys = grouped_matmul_triton(xa, b, sizes, config=expand_cfg, interpret=interpret)  # [T, out], zero past groups
    return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)  # [T, out] in token order


def lora_segment_delta_interpret(x, group, slots, **kw) -> jax.Array:
    """The same in the Pallas interpreter (CPU tests; the "gpu_interpret" matmul backend)."""
    return lora_segment_delta(x, group, slots, interpret=True, **kw)
