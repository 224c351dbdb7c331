"""How Hugging Face tensors become parameters: one reader per transform of the weight map, each building a `Leaf`
that reads any slice of its parameter from the source tensors, touching only the bytes of that slice.

Sources are numpy arrays or array-like views (`shape` and `__getitem__` over slices: memory maps, de-quantizing
views); `Leaf.read(index)` takes one slice per parameter axis (step 1), as `jax.make_array_from_callback` asks for a
device's shard, and the whole index reads the whole parameter. A large read is done in blocks along the leaf's
`block_axis` (the axis whose slices are contiguous runs of the source: experts, rows of a Linear weight) into one
preallocated array of the parameter's dtype, so its transient copies (de-quantized float32, transposes, casts) are
one block's, not the whole parameter's (gpt-oss-120b's MXFP4 gate_up is 8.5 GB in float32 per layer). `Reads` logs
(tensor name, shape read, bytes) per read, so tests can check that a device reads its slice and nothing more.

Sources in a GGML block format kept quantized (GGUF tensors offering raw `blocks`) can instead be read into a
`quant.GGMLWeight` (`blocks`: a Linear, gate and up, experts, or the embedding table), their bytes copied as they
are, whole or any device's slice of them; quantized checkpoint tensors offering `quantized(dtype)`
(`loader.hf_quant`) whole into their `netra_jax.quant` weight (`quantized`: a Linear, or gate and up fused along
their outputs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from netra_jax.ops import ggml_blocks
from netra_jax.quant import GGMLWeight, concatenate_outputs

Index = tuple[slice, ...]
BLOCK_BYTES = 64 << 20  # float32 bytes of one block of a read (its transient copies are a few of these)


class WeightError(ValueError):
    """A checkpoint lacks a tensor the model needs, or a tensor has the wrong shape."""


@dataclass
class Leaf:
    """One parameter: its global shape and dtype, and `read(index) -> numpy slice` of it (`read_block` reads one
    block; `block_axis`: the axis a large read is split along)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read_block: Callable[[Index], np.ndarray]
    block_axis: int = 0

    def read(self, idx: Index) -> np.ndarray:
        """The slice `idx` (one step-1 slice per axis), read in blocks of about `BLOCK_BYTES` (as float32) along
        `block_axis` into one array of the leaf's dtype."""
        if not self.shape:
            return self.read_block(idx)
        ax = self.block_axis
        extent = [s.stop - s.start for s in idx]
        row_bytes = 4 * int(np.prod(extent[:ax] + extent[ax + 1 :], dtype=np.int64))  # one index along ax
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        if step >= extent[ax]:
            return self.read_block(idx)
        out = np.empty(extent, self.dtype)
        for start in range(0, extent[ax], step):
            part = slice(start, min(start + step, extent[ax]))
            block = list(idx)
            block[ax] = slice(idx[ax].start + part.start, idx[ax].start + part.stop)
            out[(slice(None),) * ax + (part,)] = self.read_block(tuple(block))
        return out

    def read_all(self) -> np.ndarray:
        return self.read(tuple(slice(0, n) for n in self.shape))


@dataclass
class Reads:
    """Log of the slices read from source tensors: (name, shape, bytes) per read."""

    log: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)

    def take(self, name: str, a: Any, idx: tuple) -> np.ndarray:
        out = np.array(a[idx])  # a memory-mapped view: slicing it reads only the slice's pages
        self.log.append((name, out.shape, out.nbytes))
        return out


@dataclass(frozen=True)
class Source:
    """A source tensor by name (`a` is its array or view)."""

    name: str
    a: Any


@dataclass(frozen=True)
class Interleaved:
    """A tensor [..., 2I] whose columns interleave gate and up (gpt-oss's `gate_up_proj`), given by its two halves
    [..., I] (array-likes, e.g. a GGUF file's separate gate and up experts), which `deinterleave` reads directly
    instead of building the interleaved tensor to take it apart again."""

    gate: Any
    up: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.gate.shape[:-1], 2 * self.gate.shape[-1])


def _rows(rows: slice, out_map: np.ndarray | None) -> slice | np.ndarray:
    """Source rows of our output slice: the slice itself, or through `out_map` (KV heads repeated for tensor
    parallelism), as a slice when the run is contiguous (a plain strided read), otherwise an index array."""
    if out_map is None:
        return rows
    r = out_map[rows]
    if r.size and np.array_equal(r, np.arange(r[0], r[0] + r.size)):
        return slice(int(r[0]), int(r[0]) + r.size)
    return r


def _span(s: slice) -> range:
    return range(s.start, s.stop)


def copy(src: Source, reads: Reads, dtype, out_map=None, offset: float = 0.0) -> Leaf:
    """The tensor as it is (cast to dtype); `offset` is added (Gemma's norms stored as w - 1); `out_map` repeats rows
    of a 1-D tensor (KV-head biases)."""
    shape = tuple(src.a.shape) if out_map is None else (len(out_map),)

    def read(idx: Index) -> np.ndarray:
        if out_map is not None:
            idx = (_rows(idx[0], out_map),)
        x = reads.take(src.name, src.a, idx).astype(dtype)
        return x + dtype.type(offset) if offset else x

    return Leaf(shape, np.dtype(dtype), read)


def linear(src: Source, reads: Reads, dtype, out_map=None) -> Leaf:
    """A torch Linear weight [out, in] stored [in, out]; `out_map[j]` = source row of our column j."""
    n_out, n_in = src.a.shape
    shape = (n_in, n_out if out_map is None else len(out_map))

    def read(idx: Index) -> np.ndarray:
        i, o = idx
        return np.ascontiguousarray(reads.take(src.name, src.a, (_rows(o, out_map), i)).T).astype(dtype)

    return Leaf(shape, np.dtype(dtype), read, block_axis=1)  # blocks of source rows


def conv1d(src: Source, reads: Reads, dtype, out_map=None) -> Leaf:
    """A weight stored [in, out] already (GPT-2's Conv1D), as it is; `out_map[j]` = source column of our column j."""
    n_in, n_out = src.a.shape
    shape = (n_in, n_out if out_map is None else len(out_map))

    def read(idx: Index) -> np.ndarray:
        i, o = idx
        return reads.take(src.name, src.a, (i, _rows(o, out_map))).astype(dtype)

    return Leaf(shape, np.dtype(dtype), read)  # blocks of source rows


def gate_up(gate: Source, up: Source, reads: Reads, dtype) -> Leaf:
    """Two Linear weights [I, hidden] -> [hidden, 2, I] (gate first)."""
    inter, hidden = gate.a.shape
    parts = (gate, up)

    def read(idx: Index) -> np.ndarray:
        h, k, i = idx
        cols = [np.ascontiguousarray(reads.take(p.name, p.a, (i, h)).T) for p in parts[k]]  # [h, i] each
        return np.stack(cols, axis=1).astype(dtype)

    return Leaf((hidden, 2, inter), np.dtype(dtype), read, block_axis=2)  # blocks of source rows


def experts_gate_up(gates: Sequence[Source], ups: Sequence[Source], reads: Reads, dtype) -> Leaf:
    """Per-expert Linear weights [I, hidden] (one gate and one up per expert) -> [E, hidden, 2, I]."""
    inter, hidden = gates[0].a.shape
    parts = (gates, ups)

    def read(idx: Index) -> np.ndarray:
        e, h, k, i = idx
        out = np.empty((e.stop - e.start, h.stop - h.start, k.stop - k.start, i.stop - i.start), dtype)
        for kk, which in enumerate(parts[k]):  # one source tensor at a time
            for ee, p in enumerate(which[e]):
                out[ee, :, kk] = reads.take(p.name, p.a, (i, h)).T
        return out

    return Leaf((len(gates), hidden, 2, inter), np.dtype(dtype), read)


def experts_down(downs: Sequence[Source], reads: Reads, dtype) -> Leaf:
    """Per-expert Linear weights [hidden, I] -> [E, I, hidden]."""
    hidden, inter = downs[0].a.shape

    def read(idx: Index) -> np.ndarray:
        e, i, h = idx
        out = np.empty((e.stop - e.start, i.stop - i.start, h.stop - h.start), dtype)
        for ee, p in enumerate(downs[e]):
            out[ee] = reads.take(p.name, p.a, (h, i)).T
        return out

    return Leaf((len(downs), inter, hidden), np.dtype(dtype), read)


def deinterleave(src: Source, reads: Reads, dtype) -> Leaf:
    """[..., 2I] with gate and up interleaved (gate = [..., ::2], up = [..., 1::2], gpt-oss) -> [..., 2, I]; an
    `Interleaved` source gives its halves directly."""
    *lead, two_i = src.a.shape

    def halves(lead_idx: list[slice], k: slice, i: slice) -> list[np.ndarray]:  # [..., n] per part in k
        if isinstance(src.a, Interleaved):
            return [reads.take(src.name, h, (*lead_idx, i)) for h in (src.a.gate, src.a.up)[k]]
        x = reads.take(src.name, src.a, (*lead_idx, slice(2 * i.start, 2 * i.stop)))  # [..., 2n], pairs (gate, up)
        return [x[..., kk::2] for kk in range(k.start, k.stop)]

    def read(idx: Index) -> np.ndarray:
        *lead_idx, k, i = idx
        out = np.empty((*(s.stop - s.start for s in lead_idx), k.stop - k.start, i.stop - i.start), dtype)
        for kk, part in enumerate(halves(lead_idx, k, i)):
            out[..., kk, :] = part
        return out

    return Leaf((*lead, 2, two_i // 2), np.dtype(dtype), read)


def has_blocks(sources: Sequence[Source]) -> bool:
    """Whether every source offers its raw GGML blocks, all in one format (so one `GGMLWeight` can hold them)."""
    return all(getattr(s.a, "blocks", None) for s in sources) and len({s.a.qtype for s in sources}) == 1


@dataclass
class KeptLeaf:
    """A parameter kept quantized: its logical (float) shape and `read_all()` -> its `netra_jax.quant` weight
    (GGML blocks, grouped integers, fp8) over numpy data."""

    shape: tuple[int, ...]
    read_all: Callable[[], Any]


@dataclass
class BlocksLeaf:
    """A parameter kept in GGML blocks: `template`, the `GGMLWeight` it becomes with a `jax.ShapeDtypeStruct` for its
    data (logical shape, format, layout), and `read(index) -> numpy uint8` of any slice of that data (one step-1
    slice per data axis; a slice of the last, byte axis covers whole blocks)."""

    template: GGMLWeight
    read: Callable[[Index], np.ndarray]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.template.shape

    def build(self, data) -> GGMLWeight:
        """The weight over `data` (all of it, or a device's shards as one jax.Array)."""
        return self.template.replace(data=data)

    def read_all(self) -> GGMLWeight:
        return self.build(self.read(tuple(slice(0, n) for n in self.template.data.shape)))


def blocks(grid: np.ndarray, reads: Reads, transposed: bool, dtype, batch_dims: int = 0) -> BlocksLeaf:
    """Sources offering raw GGML rows [rows, row_bytes] laid out in `grid` (a numpy object array of `Source`s: () for
    a Linear or a table, (2,) for gate and up, (E, 2) or (E,) for experts) as one `GGMLWeight` with data
    [*grid.shape, rows, row_bytes] (see its docstring for `transposed` and `batch_dims`) de-quantizing to `dtype`.
    A read of one source's whole rows hands them over as the source gives them (a view of a memory map: the caller
    copies them once, to the device); other reads copy their slice of each source."""
    first = grid.flat[0].a
    rows, k = first.shape
    row_bytes = ggml_blocks.row_bytes(first.qtype, k)
    data = jax.ShapeDtypeStruct((*grid.shape, rows, row_bytes), np.uint8)
    template = GGMLWeight(data, first.qtype, transposed, np.dtype(dtype), batch_dims)

    def take(src: Source, r: slice, b: slice) -> np.ndarray:
        part = src.a.blocks(r)
        whole = b.start == 0 and b.stop == row_bytes
        out = part if whole else np.ascontiguousarray(part[:, b])
        reads.log.append((src.name, out.shape, out.nbytes))
        return out

    def read(idx: Index) -> np.ndarray:
        *lead, r, b = idx
        if not lead:
            return take(grid[()], r, b)
        out = np.empty((*(s.stop - s.start for s in lead), r.stop - r.start, b.stop - b.start), np.uint8)
        sub = grid[tuple(lead)]
        for pos in np.ndindex(*sub.shape):
            out[pos] = take(sub[pos], r, b)
        return out

    return BlocksLeaf(template, read)


def has_quantized(sources: Sequence[Source]) -> bool:
    """Whether every source is a quantized checkpoint tensor (offering `quantized(dtype)`), all of one format."""
    return all(callable(getattr(s.a, "quantized", None)) for s in sources) and len({s.a.qformat for s in sources}) == 1


def quantized(sources: Sequence[Source], reads: Reads, shape: tuple[int, ...], dtype) -> KeptLeaf:
    """The sources' quantized weights ([in, out_i] each: a Linear, or gate then up) as one weight of logical `shape`
    de-quantizing to `dtype`, fused along the outputs as they are stored (`quant.concatenate_outputs`)."""

    def read_all():
        parts = [s.a.quantized(dtype) for s in sources]
        for s, p in zip(sources, parts, strict=True):
            reads.log.append((s.name, tuple(s.a.shape), sum(a.nbytes for a in jax.tree.leaves(p))))
        try:
            return concatenate_outputs(parts, tuple(shape))
        except ValueError as e:
            raise WeightError(f"{', '.join(s.name for s in sources)}: {e}") from None

    return KeptLeaf(tuple(shape), read_all)


def kv_row_map(num_kv_heads: int, head_dim: int, replicas: int) -> np.ndarray | None:
    """Source row of each row of KV heads repeated `replicas` times (column j of expanded head j // head_dim reads
    row (j // head_dim // replicas) * head_dim + j % head_dim); None when nothing is repeated."""
    if replicas == 1:
        return None
    j = np.arange(num_kv_heads * replicas * head_dim)
    return (j // head_dim) // replicas * head_dim + j % head_dim
