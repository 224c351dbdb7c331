"""Hugging Face checkpoint directories: one or many `*.safetensors` shards (with an index json), read through
memory maps so a tensor is only paged in when converted. Pickled checkpoints (`*.bin`, `*.pt`) are refused.
gpt-oss's MXFP4 experts (`<name>_blocks` + `<name>_scales`) read as `<name>` in the bf16 checkpoint's layout,
de-quantizing only the slice asked for."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from netra_jax.loader.errors import CheckpointError
from netra_jax.loader.mxfp4 import dequantize_gpt_oss_experts

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # FP8 checkpoints' weights (loader.hf_quant)
}


def _libc():
    """glibc, for malloc_trim (None elsewhere: musl, macOS)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def release_pages(mm: mmap.mmap) -> None:
    """Drop a memory-mapped file's pages from this process's memory (they stay in the OS page cache) and hand the
    heap's free pages back: after tensors were copied out, so reading a file tensor by tensor holds one tensor's pages
    and transients at a time, not the whole file's (glibc keeps freed blocks of up to 32 MB in its heap)."""
    mm.madvise(mmap.MADV_DONTNEED)
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# the base model's prefix in a task model's tensor names (Llama-style, GPT-2, GPT-NeoX), absent from a base model's
_BASE_PREFIXES = ("model.", "transformer.", "gpt_neox.")


def stored_float_dtype(model_dir: str | Path) -> str | None:
    """The floating dtype holding most of a checkpoint's bytes ("float32" | "float16" | "bfloat16"), read from the
    safetensors headers alone; None when there is no readable safetensors file. The dtype of a checkpoint whose
    config.json names none (published gpt-oss configs do not: bfloat16 weights, MXFP4 experts)."""
    size: dict[str, int] = {}
    for path in Path(model_dir).glob("*.safetensors"):
        try:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError):
            continue  # a damaged file is reported by the loader itself
        for name, meta in header.items():
            if name != "__metadata__" and meta.get("dtype") in _FLOAT_DTYPES:
                a, b = meta["data_offsets"]
                size[_FLOAT_DTYPES[meta["dtype"]]] = size.get(_FLOAT_DTYPES[meta["dtype"]], 0) + b - a
    return max(size, key=size.get) if size else None


class SafetensorsShard:
    """Zero-copy numpy views of the tensors of one safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:  # the library validates the header and that the data section covers every tensor
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: invalid or truncated safetensors file ({e})") from e
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        self._base = 8 + n
        with open(path, "rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._meta = {k: header[k] for k in names}

    def keys(self):
        return self._meta.keys()

    def get(self, name: str) -> np.ndarray:
        m = self._meta[name]
        if m["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {m['dtype']}")
        a, b = m["data_offsets"]
        raw = np.frombuffer(self._mm, np.uint8, count=b - a, offset=self._base + a)  # a read-only view
        return raw.view(_DTYPES[m["dtype"]]).reshape(m["shape"])

    def drop_pages(self) -> None:
        release_pages(self._mm)


class Mxfp4Experts:
    """gpt-oss expert tensor `<name>` of an MXFP4 pair: blocks [E, rows, G, 16] + scales [E, rows, G] read as the
    bf16 checkpoint's [E, G * 32, rows] (`mxfp4.dequantize_gpt_oss_experts`), de-quantizing per slice only the
    experts, rows and 32-value groups the slice covers."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray):
        if blocks.ndim != 4 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
            raise CheckpointError(f"MXFP4 expert blocks {blocks.shape} and scales {scales.shape} do not match")
        self.blocks, self.scales = blocks, scales
        e, rows, groups, _ = blocks.shape
        self.shape = (e, groups * 32, rows)
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, idx: tuple[slice, slice, slice]) -> np.ndarray:

        e, cols, rows = (s if isinstance(s, slice) else slice(s, s + 1) for s in idx)
        c0, c1, step = cols.indices(self.shape[1])
        if step != 1:
            raise ValueError("strided MXFP4 read")
        g0, g1 = c0 // 32, -(-c1 // 32)
        out = dequantize_gpt_oss_experts(self.blocks[e, rows, g0:g1], self.scales[e, rows, g0:g1])  # [e, in, rows]
        return out[:, c0 - g0 * 32 : c1 - g0 * 32]


class HFCheckpoint:
    """All tensors of a HF model directory, by name."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        files = sorted(d.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
            if pickles:
                raise CheckpointError(
                    f"{d} holds only pickled weights ({', '.join(pickles)}); pickles are never loaded — "
                    "convert the checkpoint to safetensors"
                )
            raise CheckpointError(f"{d} has no *.safetensors weights")
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise CheckpointError(f"{d}: shards named in the index are missing: {', '.join(missing)}")
            files = [d / n for n in names]
        self.shards = [SafetensorsShard(f) for f in files]
        self._where = {k: s for s in self.shards for k in s.keys()}

    def _mxfp4(self, name: str) -> bool:
        return name not in self._where and f"{name}_blocks" in self._where and f"{name}_scales" in self._where

    def _stored(self, name: str) -> str:
        """`name`, or `name` without its base model's prefix when only that is stored: a base model saved on its own
        (Qwen3-Embedding's Qwen3Model weights are `embed_tokens.weight`, `layers.0. ...`, `norm.weight`; GPT-2's
        published checkpoint `wte.weight`, `h.0. ...`)."""
        if name in self._where:
            return name
        for prefix in _BASE_PREFIXES:
            bare = name.removeprefix(prefix)
            if bare != name and (bare in self._where or self._mxfp4(bare)):
                return bare
        return name

    def has(self, name: str) -> bool:
        name = self._stored(name)
        return name in self._where or self._mxfp4(name)

    def get(self, name: str) -> np.ndarray | Mxfp4Experts:
        name = self._stored(name)
        if self._mxfp4(name):
            return Mxfp4Experts(self.get(f"{name}_blocks"), self.get(f"{name}_scales"))
        try:
            return self._where[name].get(name)
        except KeyError:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}") from None

    def keys(self):
        return self._where.keys()

    def drop_pages(self) -> None:
        """Drop every shard's pages from this process's memory (`release_pages`)."""
        for shard in self.shards:
            shard.drop_pages()
