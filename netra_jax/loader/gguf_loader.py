"""GGUF files: a fast header parser (metadata + tensor table, bounds-checked) and de-quantization through
`gguf.quants` (llama.cpp tensor names -> the weight map's Hugging Face names: `loader.gguf_names`).

The header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy view per metadata element and
takes about 5 s on a 49k-token vocabulary; this parser takes a fraction of a second. Tensor data stays memory-mapped
until a tensor is de-quantized. De-quantization is `gguf.quants.dequantize` (F32, F16, BF16, Q4_0..Q8_0,
Q2_K..Q6_K, the IQ types, TQ1_0/TQ2_0, MXFP4 and whatever else that library implements), plus Q8_K here."""

from __future__ import annotations

import importlib.metadata
import itertools
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from netra_jax.loader.errors import CheckpointError
from netra_jax.loader.hf import release_pages
from netra_jax.ops.ggml_blocks import FORMATS

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file named *.gguf or starting with the GGUF magic (False for a directory or no file)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


_GGUF_VERSION = importlib.metadata.version("gguf")
_SCALARS = {  # GGUF value type -> struct format (little endian)
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NP_SCALARS = {  # GGUF value type -> numpy dtype, for whole arrays at once
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


class _Cursor:
    """Sequential little-endian reads over the file's bytes; running past the end is a truncation error."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.off, self.size = buf, path, 0, len(buf)

    def take(self, n: int) -> int:
        start = self.off
        if n < 0 or start + n > self.size:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF header (needs byte {start + n}, file has {self.size})"
            )
        self.off = start + n
        return start

    def scalar(self, vtype: int):
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))
        if vtype == _FLOAT32:  # the shortest decimal that round-trips in float32 (1e-05, not 9.99999974e-06)
            v = float(str(np.float32(v)))
        return v

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: corrupt GGUF header (string at byte {start} is not UTF-8)") from e

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if etype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[etype])
                start = self.take(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=start)
                return [float(str(x)) for x in arr] if etype == _FLOAT32 else arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise CheckpointError(f"{self.path}: corrupt GGUF header (unknown value type {vtype} at byte {self.off})")
        return self.scalar(vtype)


class GGUFTensorInfo:
    """Where one tensor's bytes are and how to read them. shape: numpy order (GGUF's ne reversed)."""

    __slots__ = ("name", "qtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...], offset: int, nbytes: int):
        self.name, self.qtype, self.shape, self.offset, self.nbytes = name, qtype, shape, offset, nbytes


class GGUFFile:
    """Metadata and memory-mapped tensors of one GGUF (v2/v3, little-endian) file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(4)
            if head != GGUF_MAGIC:
                raise CheckpointError(f"{self.path} is not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")
            if size < 24:
                raise CheckpointError(f"{self.path}: truncated GGUF file ({size} bytes)")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._mm, self.path)
        cur.take(4)
        self.version = cur.scalar(4)
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(4)
            if n_dims > 8:
                raise CheckpointError(f"{self.path}: corrupt GGUF tensor table ({name!r} has {n_dims} dims)")
            ne = [cur.scalar(10) for _ in range(n_dims)]
            raw_type, offset = cur.scalar(4), cur.scalar(10)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown GGML type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if ne and ne[0] % block:
                raise CheckpointError(f"{self.path}: tensor {name!r} row of {ne[0]} is not a multiple of {block}")
            nbytes = int(np.prod(ne, dtype=np.int64)) // block * type_size
            infos.append((name, qtype, tuple(reversed(ne)), offset, nbytes))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise CheckpointError(f"{self.path}: invalid general.alignment {align}")
        data_start = -(-cur.off // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, qtype, shape, offset, nbytes in infos:
            end = data_start + offset + nbytes
            if end > size:
                raise CheckpointError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte {end}, the file has {size} bytes"
                )
            if name in self.tensors:
                raise CheckpointError(f"{self.path}: duplicate tensor {name!r}")
            self.tensors[name] = GGUFTensorInfo(name, qtype, shape, data_start + offset, nbytes)
        self._check_disjoint()

    def _check_disjoint(self) -> None:
        """Refuse a tensor table whose tensors overlap: a corrupt type or shape makes a tensor read its neighbour's
        bytes, a silently wrong model that no size check at the file's end would catch."""
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for t, nxt in itertools.pairwise(by_offset):
            if t.offset + t.nbytes > nxt.offset:
                raise CheckpointError(
                    f"{self.path}: corrupt GGUF tensor table: tensor {t.name!r} ({t.qtype.name} {list(t.shape)}, "
                    f"{t.nbytes} bytes) runs into tensor {nxt.name!r}"
                )

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view, shaped [..., bytes per row]."""
        info = self.tensors[name]
        flat = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(gguf.quant_shape_to_byte_shape(info.shape, info.qtype) if info.shape else (info.nbytes,))

    def kept_tensors(self) -> list[str]:
        """Names of the tensors in a GGML block format the runtime keeps quantized (`ops.ggml_blocks.FORMATS`)."""
        return [n for n, t in self.tensors.items() if t.qtype.name in FORMATS and len(t.shape) == 2]

    def drop_pages(self) -> None:
        """Drop the file's pages from this process's memory (they stay in the OS page cache) and hand the heap's
        free pages back: after tensors were copied out, so reading a file tensor by tensor holds one tensor's pages
        and transients at a time, not the whole file's (glibc keeps freed blocks of up to 32 MB in its heap)."""
        release_pages(self._mm)

    def tensor(self, name: str) -> np.ndarray:
        """De-quantized float32 copy-or-view of a tensor, numpy shape (GGUF dims reversed)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        info = self.tensors[name]
        return dequantize(self.raw(name), info.qtype, info.shape, f"{self.path}: tensor {name!r}")


def _dequantize_q8_k(raw: np.ndarray) -> np.ndarray:
    """Q8_K, which gguf-py does not de-quantize (ggml-common.h block_q8_K): per 256 values a float32 scale d,
    int8 qs[256] and int16 bsums[16] (sums of 16 qs, for dot products; unused here); value = d * q."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 292)  # [blocks, 4 + 256 + 2 * 16]
    d = blocks[:, :4].copy().view(np.float32)  # [blocks, 1]
    return d * blocks[:, 4:260].view(np.int8)  # [blocks, 256]


_OWN_DEQUANTIZERS = {GGMLQuantizationType.Q8_K: _dequantize_q8_k}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], what: str = "tensor"):
    """Bytes [..., row bytes] of GGML type `qtype` -> float32 array of `shape`."""
    try:
        out = _OWN_DEQUANTIZERS[qtype](raw) if qtype in _OWN_DEQUANTIZERS else gguf.quants.dequantize(raw, qtype)
    except NotImplementedError:
        raise CheckpointError(
            f"{what} has GGML type {qtype.name}, which the installed gguf package ({_GGUF_VERSION}) cannot "
            "de-quantize; use a file quantized to another type (e.g. Q4_K_M, Q8_0 or F16)"
        ) from None
    return np.asarray(out, dtype=np.float32).reshape(shape)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, lists), e.g.
    `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`, `tokenizer.ggml.token_type`, `tokenizer.chat_template`."""
    return dict(GGUFFile(path).metadata)
