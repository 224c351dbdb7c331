"""Weights re-laid at load for the kernels of a matmul backend (`quant.matmul.LAYOUTS`), both ways between GGML
blocks and grouped integers:
- `for_gpu` (the GPU backends): GGUF's Q4_0 and Q8_0 blocks are exactly `PackedIntWeight`s (32-value groups, the
  file's fp16 d, w = d * (q - 8) or d * q), so they become that layout for the Pallas W4A16 / W8A16 kernel, and so
  do per-channel int8 weights (one group of all K rows); the other GGML types have no GPU kernel and are
  de-quantized to their float dtype.
- `for_cpu` (the CPU backends): AWQ / GPTQ / compressed-tensors grouped integers become the GGML blocks the CPU
  kernels stream (4 bits: Q4_0 when symmetric, Q4_1 with zero points; 8 bits symmetric: Q8_0), act-order weights
  with their rows sorted by group (`PermutedWeight`); for "cpu_rows_q8" (int8 activations, a GGUF file's default)
  Q4_K and Q6_K matmul weights also get their rows interleaved by 16 (`cpu_q8_weight`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops import cpu_kernels, ggml_blocks
from netra_jax.quant.weights import GGMLWeight, PackedIntWeight, PermutedWeight, QuantizedWeight

__all__ = [
    "cpu_q8_weight",
    "cpu_weight",
    "for_cpu",
    "for_gpu",
    "ggml_from_packed",
    "gpu_weight",
    "pack_along_k",
    "packed_from_ggml",
    "packed_from_int8",
]


def pack_along_k(q: jax.Array, bits: int) -> jax.Array:
    """Unsigned `bits`-bit integers q [K, N] -> int32 words [K * bits / 32, N], value j of word i at bits
    [bits * j, bits * (j + 1)) for k = i * 32 / bits + j (PackedIntWeight's layout)."""
    per = 32 // bits
    k, n = q.shape
    if k % per:
        raise ValueError(f"pack_along_k: K={k} is not a multiple of {per} {bits}-bit values a word")
    lanes = q.astype(jnp.uint32).reshape(k // per, per, n)  # [K / per, per, N]
    shifts = (jnp.arange(per, dtype=jnp.uint32) * bits)[None, :, None]
    words = jnp.sum(lanes << shifts, axis=1, dtype=jnp.uint32)  # disjoint bits: the sum is the OR
    return jax.lax.bitcast_convert_type(words, jnp.int32)


@functools.partial(jax.jit, static_argnums=1)  # one program per shape and type
def _repack(data: jax.Array, qtype: str) -> tuple[jax.Array, jax.Array]:
    q, d = ggml_blocks.symmetric_rows(data, qtype)  # [N, K], [N, K / 32]
    return pack_along_k(q.T, ggml_blocks.SYMMETRIC[qtype][0]), d.T  # [K * bits / 32, N], [K / 32, N]


def packed_from_ggml(w: GGMLWeight) -> PackedIntWeight | None:
    """A Q4_0 or Q8_0 matmul weight as the same values in PackedIntWeight's layout (symmetric, group 32, float16
    scales: its de-quantization rounds d * (q - offset) to float16, within the bf16 models' own rounding), or None
    for other types, for embedding tables (read by rows) and for MoE experts (the grouped matmul reads their blocks)."""
    if w.qtype not in ggml_blocks.SYMMETRIC or not w.transposed or w.batch_dims:
        return None
    packed, scale = _repack(w.data.reshape(-1, w.data.shape[-1]), w.qtype)  # rows [*out, row_bytes] flattened
    bits = ggml_blocks.SYMMETRIC[w.qtype][0]
    return PackedIntWeight(packed, scale, None, None, bits=bits, group=32, shape=w.shape, dtype=w.dtype)


@jax.jit
def _repack_int8(q: jax.Array) -> jax.Array:
    return pack_along_k(q.reshape(q.shape[0], -1).astype(jnp.int32) + 128, 8)  # [K / 4, N]


def packed_from_int8(w: QuantizedWeight) -> PackedIntWeight | None:
    """A per-output-channel int8 weight as PackedIntWeight (8 bits, q + 128 around the symmetric 128, one group of
    all K rows, its float32 scales: the same arithmetic), or None for fp8 weights (`ops.fp8_matmul` reads them) and
    for MoE experts (the grouped matmul reads them)."""
    if w.q.dtype != jnp.int8 or w.batch_dims:
        return None
    k = w.shape[0]
    scale = w.scale.reshape(1, -1)  # [1, N]
    return PackedIntWeight(_repack_int8(w.q), scale, None, None, bits=8, group=k, shape=tuple(w.shape))


def gpu_weight(w):
    """One parameter re-laid for the GPU kernels: GGML Q4_0 and Q8_0 and int8 as PackedIntWeight, the other GGML
    types de-quantized to their float dtype (no kernel of ours reads them on GPU); fp8 weights stay as they are, and
    so do GGML embedding tables (their rows are de-quantized as they are looked up), MoE experts (the grouped matmul
    de-quantizes the experts a step uses) and everything else."""
    if isinstance(w, QuantizedWeight):
        return packed_from_int8(w) or w
    if not isinstance(w, GGMLWeight) or not w.transposed or w.batch_dims:
        return w  # not a matmul weight, a table read by rows, or experts (models.moe reads their blocks)
    packed = packed_from_ggml(w)
    return w.dequantize() if packed is None else packed


def for_gpu(params):
    """`params` with every weight re-laid by `gpu_weight`."""
    return jax.tree.map(gpu_weight, params, is_leaf=lambda v: isinstance(v, GGMLWeight | QuantizedWeight))


def _ggml_type(w: PackedIntWeight) -> str | None:
    """The GGML type holding w's values as they are: 4 bits as Q4_0 (symmetric: every zero point 8) or Q4_1 (d * q
    + m, m = -zero * d), 8 bits as Q8_0 when symmetric; None otherwise (8 bits with zero points, other widths)."""
    middle = 1 << (w.bits - 1)
    symmetric = w.zero is None or bool(np.all(np.asarray(w.zero) == middle))
    if w.bits == 4:
        return "Q4_0" if symmetric else "Q4_1"
    return "Q8_0" if w.bits == 8 and symmetric else None


@functools.partial(jax.jit, static_argnums=3)  # one program per shape and type
def _blocks(w: PackedIntWeight, order: jax.Array | None, block_group: jax.Array, qtype: str) -> jax.Array:
    q = w.values()  # [K, N]
    if order is not None:
        q = q[order]  # the input rows sorted by group
    d = w.scale[block_group]  # [K / 32, N]: each 32-row block's group scale
    m = None
    if qtype == "Q4_1":
        m = (-(w.zero[block_group].astype(jnp.float32) * d.astype(jnp.float32))).T  # rounded to fp16 in the block
    return ggml_blocks.pack_rows(q.T, d.T, qtype, m)  # [N, K / 32 * block_bytes]


def ggml_from_packed(w: PackedIntWeight) -> GGMLWeight | PermutedWeight | None:
    """A grouped integer weight as the GGML blocks of `_ggml_type` (rows sorted by group first when it has an
    act-order g_idx: a PermutedWeight), or None when its values do not fit them as they are: another bit width, K or
    a group not in whole 32-row blocks, or scales that float16 does not hold exactly (the blocks' d is fp16).
    Q4_1's m = -zero * scale is rounded once to fp16 (at most 2^-11 of zero * scale, the order of the format's own
    fp16 rounding of each de-quantized weight)."""
    qtype = _ggml_type(w)
    k = w.shape[0]
    if qtype is None or k % 32:
        return None
    scale = np.asarray(w.scale)
    if not np.array_equal(scale.astype(np.float16).astype(np.float32), scale.astype(np.float32)):
        return None
    order = None if w.g_idx is None else np.argsort(np.asarray(w.g_idx), kind="stable").astype(np.int32)
    groups = np.asarray(w.groups()) if order is None else np.asarray(w.g_idx)[order]  # [K] in stored order
    blocks = groups.reshape(-1, 32)
    if not np.all(blocks == blocks[:, :1]):
        return None  # a 32-row block spans two groups
    data = _blocks(w, order, jnp.asarray(blocks[:, 0]), qtype)
    out = GGMLWeight(data.reshape(*w.shape[1:], -1), qtype, True, jnp.dtype(w.dtype))  # [*out, row_bytes]
    return out if order is None else PermutedWeight(out, jnp.asarray(order))


def cpu_weight(w):
    """One parameter re-laid for the CPU kernels: a grouped integer weight (AWQ, GPTQ, compressed-tensors
    pack-quantized) as the GGML blocks they read (`ggml_from_packed`; one that does not fit keeps the jnp
    reference); anything else as it is."""
    return (ggml_from_packed(w) or w) if isinstance(w, PackedIntWeight) else w


def cpu_q8_weight(w):
    """One parameter re-laid for the "cpu_rows_q8" kernels: as `cpu_weight`, then a matmul weight of a type with an
    interleaved layout (Q4_K, Q6_K -> Q4_K_X16, Q6_K_X16: `ggml_blocks.interleave_rows`) in it, when this machine's
    build reads it (`cpu_kernels.interleaved_rows()`: AVX-512 VNNI), its rows come in whole groups and it lives on
    one device: the same values and size, which the int8 kernel reads 16 rows at a time (a core streams them
    1.45-1.6x faster). Anything else as it is."""
    w = cpu_weight(w)
    if not isinstance(w, GGMLWeight) or not w.transposed or w.batch_dims or w.data.ndim < 2:
        return w  # (several output axes, as gate and up stacked [2, I, row_bytes]: groups along the last of them)
    layout = ggml_blocks.interleaved_layout(w.qtype)
    if layout is None:
        return w
    rows = ggml_blocks.FORMATS[layout].interleaved
    one_device = not isinstance(w.data, jax.Array) or len(w.data.sharding.device_set) == 1
    if w.data.shape[-2] % rows or not one_device or cpu_kernels.interleaved_rows() != rows:
        return w
    # on the host at memory speed (the jnp reference holds int32 copies of the values: 3 GB more for an 8 B head)
    laid = cpu_kernels.interleave(np.asarray(w.data), w.qtype)
    return w.replace(
        data=jax.device_put(laid, w.data.sharding) if isinstance(w.data, jax.Array) else laid, qtype=layout
    )


def for_cpu(params):
    """`params` with every weight re-laid by `cpu_weight`."""
    return jax.tree.map(cpu_weight, params, is_leaf=lambda v: isinstance(v, PackedIntWeight))
