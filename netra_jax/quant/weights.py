"""Quantized weights as registered pytree nodes that sit in the parameter tree where the float arrays they stand for
would: per-channel int8/fp8 (`QuantizedWeight`), a GGUF file's blocks as they are (`GGMLWeight`), grouped integer
weights (`PackedIntWeight`: AWQ, GPTQ, compressed-tensors pack-quantized), fp8 with a scale per 2-D tile
(`BlockFP8Weight`: DeepSeek / Qwen FP8 checkpoints) and any of them with its input rows stored in another order
(`PermutedWeight`). Each knows its logical shape, its jnp de-quantization (the
ground truth every matmul kernel is tested against) and how a tensor-parallel split of the parameter splits its
arrays (`shard_specs`); `concatenate_outputs` fuses weights of one input axis along their outputs (gate and up)
without de-quantizing them."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from netra_jax.ops import ggml_blocks


@flax.struct.dataclass
class QuantizedWeight:
    """Per-output-channel symmetric weight: w[*b, k, *n] = q[*b, k, *n] * scale[*b, *n], with `batch_dims` leading
    axes (*b: the expert axis of MoE experts, one scale per expert and output channel) before the input axis k."""

    q: jax.Array  # [*batch, in, *out] int8 or float8_e4m3fn
    scale: jax.Array  # [*batch, *out] float32, one per output channel
    batch_dims: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        scale = jnp.expand_dims(self.scale, self.batch_dims)  # [*batch, 1, *out]
        return (self.q.astype(jnp.float32) * scale).astype(dtype)


@flax.struct.dataclass
class GGMLWeight:
    """A GGUF tensor kept in its GGML blocks: data uint8 [*lead, row_bytes], each row K values in K / QK blocks of
    `qtype` (exactly the file's bytes, the rows shaped by the parameter's other axes). It stands for a float
    parameter whose logical `shape` follows from the data's:
    - transposed=True: a matmul weight [*batch, K, *out] (our [in, out] layout, `batch_dims` leading axes such as
      the experts of a MoE layer) with data [*batch, *out, row_bytes]: a row per output feature;
    - transposed=False: a table [*rows, K] read by rows (the token embedding) with data [*rows, row_bytes].
    Keeping the output axes in the data lets a split of any of them be a split of the data (tensor parallelism).
    `dtype`: the float dtype it de-quantizes to (the model's compute dtype)."""

    data: jax.Array  # [*batch, *out, row_bytes] or [*rows, row_bytes] uint8
    qtype: str = flax.struct.field(pytree_node=False)
    transposed: bool = flax.struct.field(pytree_node=False, default=True)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))
    batch_dims: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def k(self) -> int:
        """Values per row (the input size of a matmul weight)."""
        f = ggml_blocks.FORMATS[self.qtype]
        return self.data.shape[-1] // f.block_bytes * f.qk

    @property
    def shape(self) -> tuple[int, ...]:
        lead = tuple(self.data.shape[:-1])
        if not self.transposed:
            return (*lead, self.k)
        b = self.batch_dims
        return (*lead[:b], self.k, *lead[b:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rows(self, idx: jax.Array | None = None) -> jax.Array:
        """The de-quantized rows [*lead, K] (or only rows `idx` of a table, e.g. token ids: [*idx.shape, K]) in
        `dtype`."""
        data = self.data if idx is None else self.data[idx]
        return ggml_blocks.dequantize_rows(data, self.qtype, self.dtype)

    def dequantize(self) -> jax.Array:
        """The float parameter it stands for, of `shape` (the reference: jnp de-quantization of every block)."""
        r = self.rows()  # [*lead, K]
        return jnp.moveaxis(r, -1, self.batch_dims) if self.transposed else r


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


@flax.struct.dataclass
class PermutedWeight:
    """A weight whose input rows are stored in another order: stored[k'] = w[perm[k']], so x @ w = x[..., perm] @
    stored (GPTQ act-order weights re-laid with each group's rows together, for kernels that read a group's rows as
    one block). `stored` is any weight of this module's types or a float array, of the logical [K, *out]."""

    stored: object  # [K, *out] in the stored row order
    perm: jax.Array  # [K] int32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stored.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def inputs_in_stored_order(self, x: jax.Array, spec: str | None = None) -> jax.Array:
        """x with its contracted axis (the last one; `spec`'s letter of the weight's input axis) in stored order."""
        axis = -1 if spec is None else spec.split(",")[0].index(spec.split(",")[1][0])
        return jnp.take(x, self.perm, axis=axis)

    def dequantize(self) -> jax.Array:
        """The float parameter of `shape`, its input rows back in their own order."""
        stored = self.stored.dequantize() if hasattr(self.stored, "dequantize") else self.stored
        return stored[jnp.argsort(self.perm)]


QUANTIZED_TYPES = (QuantizedWeight, GGMLWeight, PackedIntWeight, BlockFP8Weight, PermutedWeight)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def embedding_rows(table, ids: jax.Array) -> jax.Array:
    """table[ids] of an embedding table [vocab, hidden], float or GGML blocks (only the rows of `ids` are
    de-quantized). A float table split over an Explicit-axis mesh (`jax.sharding.AxisType.Explicit`, which wants a
    gather's output sharding spelled out) gives its rows replicated over that mesh."""
    if isinstance(table, GGMLWeight):
        return table.rows(ids)
    mesh = jax.typeof(table).sharding.mesh
    if not mesh.explicit_axes:
        return table[ids]
    return table.at[ids].get(out_sharding=jax.sharding.NamedSharding(mesh, P()))


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


def shard_specs(w, spec: P, tp: int = 1, name: str = "weight"):
    """The PartitionSpecs of w's arrays (a pytree shaped like w) when the float parameter it stands for is split by
    `spec` over `tp` devices: a per-channel weight's scales split with its output axes; GGML blocks split along their
    output axes by rows and along K by whole blocks, which needs K / tp to be a multiple of the format's QK
    (ValueError naming `name` otherwise). A float parameter (or its stand-in) keeps `spec`."""
    if not is_quantized(w):
        return spec
    axes = (*spec, *(None,) * (w.ndim - len(spec)))  # one entry per logical axis
    if isinstance(w, QuantizedWeight):
        b = w.batch_dims
        return w.replace(q=P(*axes), scale=P(*axes[:b], *axes[b + 1 :]))
    if isinstance(w, GGMLWeight):
        k_axis = w.batch_dims if w.transposed else w.ndim - 1
        if axes[k_axis] is not None:
            qk = ggml_blocks.FORMATS[w.qtype].qk
            if w.k % (tp * qk):
                raise ValueError(
                    f"{name}: its {w.qtype} rows of {w.k} values split {tp} ways into {w.k / tp:g}, not a multiple "
                    f"of the format's {qk}-value blocks; use another tensor_parallel_size, or --quantization int8 "
                    "or fp8"
                )
        rest = axes[:k_axis] + axes[k_axis + 1 :]  # the data's leading axes, in order
        return w.replace(data=P(*rest, axes[k_axis]))
    if any(a is not None for a in axes):
        raise ValueError(f"{name}: a {type(w).__name__} cannot be split for tensor parallelism")
    return jax.tree.map(lambda _: P(), w)
