"""Pallas (Triton lowering) KV-cache write, kept for the GPU check to time against the runtime's write: scatters a
step's keys and values into their page slots in place (page arrays aliased to the outputs). Same contract as
`netra_jax.ops.attention.write_kv`, the XLA scatter the runtime uses, which donation also makes in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(slot_ref, k_ref, v_ref, kp_in, vp_in, kp_ref, vp_ref, *, head_dim_padded: int):
    # slot_ref [T]; k_ref, v_ref [T, KH, D]; kp_ref, vp_ref [num_pages, page_size, KH, D] (aliased to kp_in, vp_in)
    del kp_in, vp_in
    t, h = pl.program_id(0), pl.program_id(1)
    num_pages, P, _, D = kp_ref.shape
    slot = slot_ref[t]
    ok = (slot >= 0) & (slot < num_pages * P)  # padding tokens carry an out-of-range slot
    slot = jnp.where(ok, slot, 0)
    d = jnp.arange(head_dim_padded, dtype=jnp.int32)  # [Dp]
    d_ok = d < D
    d_idx = jnp.minimum(d, D - 1) if head_dim_padded != D else d
    mask = d_ok & ok  # [Dp]
    for src, dst in ((k_ref, kp_ref), (v_ref, vp_ref)):
        row = plgpu.load(src.at[t, h, d_idx], mask=d_ok, other=0)  # [Dp]
        plgpu.store(dst.at[slot // P, slot % P, h, d_idx], row.astype(dst.dtype), mask=mask)


def write_kv_triton(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write k, v [T, kv_heads, head_dim] into k_pages, v_pages [num_pages, page_size, kv_heads, head_dim] at
    slot_mapping [T] (page * page_size + offset; out-of-range slots are skipped). One program per (token, KV head);
    donate the page arrays in the enclosing jit to make the update in place."""
    T, KH, D = k.shape
    if k_pages.shape[2:] != (KH, D) or v_pages.shape != k_pages.shape or v.shape != k.shape:
        raise ValueError(f"shape mismatch: k {k.shape}, v {v.shape}, pages {k_pages.shape}, {v_pages.shape}")
    Dp = 1 << max(0, D - 1).bit_length()
    return pl.pallas_call(
        functools.partial(_kernel, head_dim_padded=Dp),
        grid=(T, KH),
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="kv_write",
    )(slot_mapping.astype(jnp.int32), k, v, k_pages, v_pages)
