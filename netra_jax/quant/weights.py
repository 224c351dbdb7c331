"""Quantized weights as registered pytree nodes that sit in the parameter tree where the float arrays they stand for
would: per-channel int8/fp8 (`QuantizedWeight`), a GGUF file's blocks as they are (`GGMLWeight`), grouped integer
weights (`PackedIntWeight`: AWQ, GPTQ, compressed-tensors pack-quantized) and fp8 with a scale per 2-D tile
(`BlockFP8Weight`: DeepSeek / Qwen FP8 checkpoints). Each knows its logical shape and its jnp de-quantization, the
ground truth every matmul kernel is tested against; `concatenate_outputs` fuses weights of one input axis along
their outputs (gate and up) without de-quantizing them."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops import ggml_blocks


@flax.struct.dataclass
class QuantizedWeight:
    """Per-output-channel symmetric weight: w[k, *n] = q[k, *n] * scale[*n]."""

    q: jax.Array  # [in, *out] int8 or float8_e4m3fn
    scale: jax.Array  # [*out] float32, one per output channel

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


@flax.struct.dataclass
class GGMLWeight:
    """A GGUF tensor kept in its GGML blocks: data uint8 [rows, row_bytes], each row K values in K / QK blocks of
    `qtype` (exactly the file's bytes). It stands for a float parameter of logical `shape`:
    - transposed=True: a matmul weight [K, *out] (our [in, out] layout; rows = prod(out), the output features);
    - transposed=False: a table [rows, K] read by rows (the token embedding).
    `dtype`: the float dtype it de-quantizes to (the model's compute dtype)."""

    data: jax.Array  # [rows, row_bytes] uint8
    qtype: str = flax.struct.field(pytree_node=False)
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    transposed: bool = flax.struct.field(pytree_node=False, default=True)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rows(self, idx: jax.Array | None = None) -> jax.Array:
        """The de-quantized rows [rows, K] (or only rows `idx`, e.g. token ids: [*idx.shape, K]) in `dtype`."""
        data = self.data if idx is None else self.data[idx]
        return ggml_blocks.dequantize_rows(data, self.qtype, self.dtype)

    def dequantize(self) -> jax.Array:
        """The float parameter it stands for, of `shape` (the reference: jnp de-quantization of every block)."""
        r = self.rows()  # [rows, K]
        return r.T.reshape(self.shape) if self.transposed else r.reshape(self.shape)


@flax.struct.dataclass
class PackedIntWeight:
    """Grouped integer weight-only quantization along the input axis (W4A16 / W8A16):
        w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n],   g(k) = k // group, or g_idx[k] when given
    with unsigned q of `bits` (4 or 8) packed along K into int32 words, value j of word i at bits [bits*j, bits*(j+1))
    (k = i * 32 / bits + j: GPTQ's qweight layout). zero=None is the symmetric form, zero = 2^(bits-1) everywhere.
    `shape` is the logical [K, *out] of the float parameter (N = prod(out)); `dtype` what it de-quantizes to."""

    packed: jax.Array  # [K * bits / 32, N] int32
    scale: jax.Array  # [K / group, N] float16, bfloat16 or float32
    zero: jax.Array | None  # [K / group, N] int32 (unpacked zero points) or None
    g_idx: jax.Array | None  # [K] int32: each input row's group (GPTQ act-order), or None = k // group
    bits: int = flax.struct.field(pytree_node=False)
    group: int = flax.struct.field(pytree_node=False)
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def values(self) -> jax.Array:
        """The unsigned integers q [K, N] (int32) unpacked from `packed`."""
        per = 32 // self.bits
        shifts = jnp.arange(per, dtype=jnp.int32) * self.bits  # [per]
        q = (self.packed[:, None, :] >> shifts[None, :, None]) & ((1 << self.bits) - 1)  # [K / per, per, N]
        return q.reshape(-1, self.packed.shape[1])

    def groups(self) -> jax.Array:
        """Each input row's group index [K]."""
        k = self.shape[0]
        return self.g_idx if self.g_idx is not None else jnp.arange(k, dtype=jnp.int32) // self.group

    def dequantize(self) -> jax.Array:
        """The float parameter of `shape`: (q - zero) * scale rounded to the scale's dtype (the formats' own fp16 /
        bf16 arithmetic), then cast to `dtype`. The product is exact in float32 (at most 8 + 11 significant bits) and
        rounded once by `reduce_precision`, which XLA keeps under jit (a bf16 multiply cast back to float32 is
        otherwise fused into one float32 multiply, skipping the rounding)."""
        g = self.groups()  # [K]
        zero = (1 << (self.bits - 1)) if self.zero is None else self.zero[g]  # scalar or [K, N]
        w = (self.values() - zero).astype(jnp.float32) * self.scale[g].astype(jnp.float32)  # [K, N], exact
        info = jnp.finfo(self.scale.dtype)
        w = jax.lax.reduce_precision(w, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return w.astype(self.dtype).reshape(self.shape)


@flax.struct.dataclass
class BlockFP8Weight:
    """fp8 (e4m3) weight with a float32 scale per tile of `block` = (block_k, block_n) values:
        w[k, n] = q[k, n] * scale[k // block_k, n // block_n]
    (the `weight_scale_inv` of checkpoints with `weight_block_size`, transposed to our [in, out]; the last tile of an
    axis may be partial). `shape` is the logical [K, *out] (N = prod(out)); `dtype` what it de-quantizes to."""

    q: jax.Array  # [K, N] float8_e4m3fn
    scale: jax.Array  # [ceil(K / block_k), ceil(N / block_n)] float32
    block: tuple[int, int] = flax.struct.field(pytree_node=False)
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self) -> jax.Array:
        """The float parameter of `shape`: q * its tile's scale in float32, then cast to `dtype`."""
        bk, bn = self.block
        k, n = self.q.shape
        scale = jnp.repeat(jnp.repeat(self.scale, bk, axis=0)[:k], bn, axis=1)[:, :n]  # [K, N]
        return (self.q.astype(jnp.float32) * scale).astype(self.dtype).reshape(self.shape)


QUANTIZED_TYPES = (QuantizedWeight, GGMLWeight, PackedIntWeight, BlockFP8Weight)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def embedding_rows(table, ids: jax.Array) -> jax.Array:
    """table[ids] of an embedding table [vocab, hidden], float or GGML blocks (only the rows of `ids` are
    de-quantized)."""
    return table.rows(ids) if isinstance(table, GGMLWeight) else table[ids]


def concatenate_outputs(parts: list, shape: tuple[int, ...]):
    """Weights of one type and input axis, each [K, N_i], as one weight of logical `shape` [K, *out] whose flattened
    outputs are the parts' columns in order (gate's then up's), their stored values moved as they are: scales and
    zero points belong to output columns and groups run along K, so this is exact.
    Raises ValueError when the parts cannot share one layout (another type, bit width, group, act-order g_idx, or an
    fp8 tile straddling two parts)."""
    first = parts[0]
    if any(type(p) is not type(first) for p in parts):
        raise ValueError(f"cannot fuse weights of different types: {', '.join(type(p).__name__ for p in parts)}")
    if isinstance(first, QuantizedWeight):
        q = np.concatenate([p.q for p in parts], axis=1)  # [K, N]
        scale = np.concatenate([p.scale for p in parts], axis=0)  # [N]
        return QuantizedWeight(q=q.reshape(shape), scale=scale.reshape(shape[1:]))
    if isinstance(first, PackedIntWeight):
        if any((p.bits, p.group) != (first.bits, first.group) for p in parts):
            raise ValueError("cannot fuse grouped weights of different bit widths or group sizes")
        if first.g_idx is not None and any(not np.array_equal(p.g_idx, first.g_idx) for p in parts):
            raise ValueError("cannot fuse act-order weights whose g_idx differ (their input rows are grouped apart)")
        if any((p.zero is None) != (first.zero is None) for p in parts):
            raise ValueError("cannot fuse a symmetric weight with one that has zero points")
        zero = None if first.zero is None else np.concatenate([p.zero for p in parts], axis=1)
        return first.replace(
            packed=np.concatenate([p.packed for p in parts], axis=1),  # [K * bits / 32, N]
            scale=np.concatenate([p.scale for p in parts], axis=1),  # [groups, N]
            zero=zero,
            shape=tuple(shape),
        )
    if isinstance(first, BlockFP8Weight):
        bn = first.block[1]
        if any(p.block != first.block for p in parts) or any(p.q.shape[1] % bn for p in parts[:-1]):
            raise ValueError(f"cannot fuse fp8 weights whose outputs are not whole tiles of {first.block}")
        return first.replace(
            q=np.concatenate([p.q for p in parts], axis=1),  # [K, N]
            scale=np.concatenate([p.scale for p in parts], axis=1),  # [K tiles, N tiles]
            shape=tuple(shape),
        )
    raise ValueError(f"cannot fuse weights of type {type(first).__name__}")
