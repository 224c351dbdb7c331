"""Hugging Face checkpoints quantized by FP8, AWQ, GPTQ or compressed-tensors, read as they are stored: each quantized
Linear weight becomes a `netra_jax.quant` weight in our [in, out] layout, never a float copy.

`scheme(quantization_config, where)` checks `config.json`'s `quantization_config` as vLLM reads it and returns a frozen
`QuantScheme` (None for no config and for gpt-oss's mxfp4, de-quantized by `loader.hf`), or raises CheckpointError in
one line naming the method or option it does not read. `view(checkpoint, scheme)` gives the (get, has) pair the weight
map reads: `get("<module>.weight")` of a quantized module is a `QuantizedTensor` (its float shape [out, in] for the
weight map's shape check, and `quantized(dtype)` building the weight: `weight_reads.quantized`); any other tensor,
ignored modules included, is the checkpoint's own.

Formats (K = in features, N = out features, G = group size; -1 = one group over K, per output channel):
- GPTQ: `qweight` [K * bits / 32, N] int32 packed along K, value j of a word at bits [bits * j, bits * (j + 1)) (our
  `PackedIntWeight` layout as it is); `qzeros` [K / G, N * bits / 32] packed the same way along N, stored as z - 1 in
  the v1 `checkpoint_format` "gptq" (z in "gptq_v2"); `scales` [K / G, N]; `g_idx` [K] each input row's group
  (act-order, `desc_act`). w = (q - z) * scale. A symmetric (`sym`) checkpoint's zeros are 2^(bits-1), as vLLM
  takes them.
- AWQ (GEMM): `qweight` [K, N / 8] packed along N in AWQ's order (nibble i of word c is column
  `8c + AWQ_ORDER[i]`, AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7), `qzeros` [K / G, N / 8] the same, `scales` [K / G, N].
  Repacked here along K: the matmul reads K-packed words, and one layout keeps one kernel.
- compressed-tensors pack-quantized: `weight_packed` [N, K * bits / 32] (the torch [out, in] layout packed along K:
  transposed here to GPTQ's), `weight_scale` [N, K / G], `weight_zero_point` [N * bits / 32, K / G] packed along N
  when asymmetric, `weight_shape` [N, K], optional `weight_g_idx`. Values are stored with an offset of 2^(bits-1),
  so a symmetric weight's zero is that offset.
- FP8 (`quant_method: "fp8"`) and compressed-tensors float-quantized: `weight` [N, K] float8_e4m3fn with
  `weight_scale_inv` [N / bn, K / bk] (`weight_block_size` [bn, bk]: `BlockFP8Weight`) or a `weight_scale` per
  tensor or per output channel (`QuantizedWeight`, its scale per column).

Activations are never quantized: an `input_activations` setting or an `activation_scheme` (static `input_scale`)
describes what a W8A8 kernel would do; here the weights are de-quantized and multiplied with float activations
(W8A16), which has no fp8 or int8 activation rounding and so is at least as close to the float model. Likewise a
compressed-tensors `kv_cache_scheme` (its k_scale / v_scale tensors) is not read: the KV cache stays in its dtype."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from netra_jax.loader.errors import CheckpointError
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.weight_reads import WeightError
from netra_jax.quant import BlockFP8Weight, PackedIntWeight, QuantizedWeight

__all__ = ["METHODS", "QuantScheme", "QuantizedTensor", "scheme", "view"]

METHODS = ("fp8", "awq", "gptq", "compressed-tensors")  # besides "mxfp4" (gpt-oss experts, loader.hf)
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's `quantization_config` says about its Linear weights.
    layout: "gptq" | "awq" | "pack" (compressed-tensors pack-quantized) | "fp8" (float8 weight with scales).
    bits, group (-1 = per output channel), sym; zero_offset: added to stored zero points (GPTQ v1 stores z - 1);
    block: fp8 tile (out, in) of `weight_block_size`, or None; ignore: module names (or "re:" patterns) left float."""

    method: str
    layout: str
    bits: int = 8
    group: int = -1
    sym: bool = True
    zero_offset: int = 0
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.layout == "fp8":
            return f"{self.method} fp8" + (f" {self.block[0]}x{self.block[1]} blocks" if self.block else "")
        return f"{self.method} {self.bits}-bit group {self.group}"


def _refuse(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: quantization_config {what}")


def _ignored(qc: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        if qc.get(key):
            return tuple(qc[key])
    return ()


def _fp8(qc: dict, where: str) -> QuantScheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(where, f"fmt {qc['fmt']!r} is not supported (fp8 weights must be e4m3)")
    if qc.get("scale_fmt", "float") != "float":
        raise _refuse(where, f"scale_fmt {qc['scale_fmt']!r} is not supported (float32 scales only)")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse(where, f"activation_scheme {qc['activation_scheme']!r} is not supported")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise _refuse(where, f"weight_block_size {block!r} is not two positive sizes")
    ignore = _ignored(qc, "modules_to_not_convert", "ignored_layers")
    return QuantScheme("fp8", "fp8", block=tuple(block) if block else None, ignore=ignore)


def _group(qc: dict, where: str) -> int:
    group = qc.get("group_size", -1)
    if group is None or group == -1:
        return -1
    if not isinstance(group, int) or group <= 0:
        raise _refuse(where, f"group_size {group!r} is not a positive size or -1")
    return group


def _awq(qc: dict, where: str) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(where, f"AWQ version {version!r} is not supported (only 'gemm')")
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise _refuse(where, f"AWQ bits {qc.get('bits', qc.get('w_bit'))!r} are not supported (only 4)")
    if not qc.get("zero_point", True):
        raise _refuse(where, "AWQ zero_point false is not supported (AWQ GEMM stores zero points)")
    if qc.get("desc_act"):
        raise _refuse(where, "desc_act (activation order) is not part of the AWQ format")
    group = _group({"group_size": qc.get("group_size", qc.get("q_group_size", 128))}, where)
    return QuantScheme("awq", "awq", bits=4, group=group, sym=False, ignore=_ignored(qc, "modules_to_not_convert"))


def _gptq(qc: dict, where: str) -> QuantScheme:
    bits = qc.get("bits", 4)
    if bits not in (4, 8):
        raise _refuse(where, f"GPTQ bits {bits!r} are not supported (4 or 8)")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    offsets = {"gptq": 1, "gptq_v2": 0}  # v1 stores each zero point minus 1
    if fmt not in offsets:
        raise _refuse(where, f"GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
    if qc.get("dynamic"):
        raise _refuse(where, "GPTQ 'dynamic' per-module overrides are not supported")
    return QuantScheme(
        "gptq",
        "gptq",
        bits=bits,
        group=_group(qc, where),
        sym=bool(qc.get("sym", True)),
        zero_offset=offsets[fmt],
        ignore=_ignored(qc, "modules_to_not_convert"),
    )


def _compressed_tensors(qc: dict, where: str) -> QuantScheme:
    if qc.get("sparsity_config"):
        raise _refuse(where, "sparsity_config (sparse compressed-tensors) is not supported")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(where, f"has {len(groups)} config_groups; one quantization scheme for all Linear layers is read")
    g = groups[0]
    fmt = g.get("format") or qc.get("format")
    w = g.get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    if g.get("output_activations"):
        raise _refuse(where, "output_activations quantization is not supported")
    if w.get("dynamic"):
        raise _refuse(where, "dynamic weight quantization is not supported")
    if fmt == "pack-quantized":
        if kind != "int" or bits not in (4, 8):
            raise _refuse(where, f"pack-quantized {kind} weights of {bits!r} bits are not supported (int 4 or 8)")
        if strategy not in ("group", "channel"):
            raise _refuse(where, f"pack-quantized weight strategy {strategy!r} is not supported (group or channel)")
        if g.get("input_activations"):
            raise _refuse(where, "integer weights with quantized input_activations (W4A8/W8A8) are not supported")
        group = _group(w, where) if strategy == "group" else -1
        return QuantScheme("compressed-tensors", "pack", bits, group, bool(w.get("symmetric", True)), ignore=ignore)
    if fmt in ("float-quantized", "naive-quantized") and kind == "float":
        if bits != 8:
            raise _refuse(where, f"float weights of {bits!r} bits are not supported (fp8 e4m3)")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(where, f"float-quantized weight strategy {strategy!r} is not supported")
        if w.get("actorder"):
            raise _refuse(where, "actorder (activation order) is not part of the float-quantized format")
        block = tuple(w["block_structure"]) if strategy == "block" else None
        return QuantScheme("compressed-tensors", "fp8", block=block, ignore=ignore)
    raise _refuse(where, f"compressed-tensors format {fmt!r} with {kind} weights is not supported")


_PARSERS: dict[str, Callable[[dict, str], QuantScheme]] = {
    "fp8": _fp8,
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
}


def scheme(qc: Any, where: str | Path) -> QuantScheme | None:
    """The checkpoint's quantization scheme (None: unquantized, or gpt-oss's mxfp4 experts); CheckpointError in one
    line for a method or option that is not read."""
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "mxfp4":
        return None
    if method not in _PARSERS:
        raise CheckpointError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (supported: "
            f"{', '.join((*METHODS, 'mxfp4'))})"
        )
    return _PARSERS[method](qc, str(where))


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized Linear weight standing for the float tensor `name` of `shape` [out, in]; `stored` names the
    tensor its size was read from; `quantized(dtype)` builds it (de-quantizing to `dtype`) in our [in, out] layout."""

    name: str
    shape: tuple[int, int]
    stored: str
    qformat: str
    build: Callable[[np.dtype], Any]

    def quantized(self, dtype) -> Any:
        return self.build(np.dtype(dtype))

    def __getitem__(self, idx) -> np.ndarray:
        raise WeightError(
            f"tensor {self.stored!r} ({self.qformat}) is quantized where a float tensor is read: quantized MoE "
            "experts, routers and embeddings are not supported"
        )


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] -> their unsigned values [R, C * 32 / bits], value j of word c at column c * per + j."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits  # [per]
    v = (words.view(np.uint32)[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # [R, C, per]
    return v.reshape(words.shape[0], -1).astype(np.int32)


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [K, N] -> int32 words [K * bits / 32, N] packed along K (GPTQ's qweight layout)."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(-1, per, values.shape[1])  # [K / per, per, N]
    shifts = np.arange(per, dtype=np.uint32)[None, :, None] * bits
    return np.bitwise_or.reduce(v << shifts, axis=1).view(np.int32)


class _Module:
    """The stored tensors of one Linear module (`prefix` = its name with the trailing dot)."""

    def __init__(self, ck: HFCheckpoint, prefix: str, sch: QuantScheme):
        self.ck, self.prefix, self.sch = ck, prefix, sch

    def name(self, suffix: str) -> str:
        return self.prefix + suffix

    def has(self, suffix: str) -> bool:
        return self.ck.has(self.name(suffix))

    def get(self, suffix: str, shape: tuple[int, ...] | None = None, dtypes: tuple = ()) -> np.ndarray:
        """The tensor, checked to have `shape` and one of `dtypes` (WeightError naming it otherwise)."""
        name = self.name(suffix)
        if not self.ck.has(name):
            raise WeightError(f"{self.sch.method} checkpoint lacks tensor {name!r}")
        a = self.ck.get(name)
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise WeightError(
                f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)} ({self.sch.describe()})"
            )
        if dtypes and a.dtype not in dtypes:
            raise WeightError(f"tensor {name!r} has dtype {a.dtype}, expected {' or '.join(map(str, dtypes))}")
        return a


_INT32 = (np.dtype(np.int32),)
_SCALES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


def _groups(sch: QuantScheme, k: int) -> tuple[int, int]:
    """(group size, number of groups) over K."""
    group = k if sch.group == -1 else sch.group
    return group, -(-k // group)


def _g_idx(m: _Module, suffix: str, k: int, group: int) -> np.ndarray | None:
    """The act-order g_idx [K] when the module stores a non-trivial one (None: row k is in group k // group)."""
    if not m.has(suffix):
        return None
    g = np.asarray(m.get(suffix, (k,), _INT32))
    return None if np.array_equal(g, np.arange(k) // group) else np.array(g)


def _gptq_tensor(m: _Module) -> tuple[tuple[int, int], str, Callable]:
    sch = m.sch
    qweight = m.get("qweight", dtypes=_INT32)
    k, n = qweight.shape[0] * 32 // sch.bits, qweight.shape[1]

    def build(dtype):
        group, groups = _groups(sch, k)
        scale = m.get("scales", (groups, n), _SCALES)
        zero = None
        if not sch.sym:
            zero = _unpack(np.asarray(m.get("qzeros", (groups, n * sch.bits // 32), _INT32)), sch.bits)
            zero = zero + sch.zero_offset  # [groups, N]
        g_idx = _g_idx(m, "g_idx", k, group)
        return PackedIntWeight(np.array(qweight), np.array(scale), zero, g_idx, sch.bits, group, (k, n), dtype)

    return (n, k), "qweight", build


def _awq_tensor(m: _Module) -> tuple[tuple[int, int], str, Callable]:
    sch = m.sch
    qweight = m.get("qweight", dtypes=_INT32)
    k, n = qweight.shape[0], qweight.shape[1] * 32 // sch.bits
    if k % (32 // sch.bits):
        raise WeightError(f"tensor {m.name('qweight')!r} has {k} input rows, not a multiple of {32 // sch.bits}")

    def from_awq_order(words: np.ndarray) -> np.ndarray:  # [R, N / 8] -> values [R, N]
        nibbles = _unpack(np.asarray(words), sch.bits).reshape(words.shape[0], -1, 8)  # [R, N / 8, nibble]
        values = np.empty_like(nibbles)
        values[:, :, AWQ_ORDER] = nibbles
        return values.reshape(words.shape[0], -1)

    def build(dtype):
        group, groups = _groups(sch, k)
        scale = m.get("scales", (groups, n), _SCALES)
        zero = from_awq_order(m.get("qzeros", (groups, n // 8), _INT32))  # [groups, N]
        packed = _pack_rows(from_awq_order(qweight), sch.bits)  # [K / 8, N]
        return PackedIntWeight(packed, np.array(scale), zero, None, sch.bits, group, (k, n), dtype)

    return (n, k), "qweight", build


def _pack_tensor(m: _Module) -> tuple[tuple[int, int], str, Callable]:
    sch = m.sch
    packed = m.get("weight_packed", dtypes=_INT32)
    n, k = packed.shape[0], packed.shape[1] * 32 // sch.bits
    stated = tuple(int(v) for v in np.asarray(m.get("weight_shape", (2,))))
    if stated != (n, k):
        raise WeightError(
            f"tensor {m.name('weight_shape')!r} says {stated}, but {m.name('weight_packed')!r} holds {(n, k)}"
        )

    def build(dtype):
        group, groups = _groups(sch, k)
        scale = np.ascontiguousarray(np.asarray(m.get("weight_scale", (n, groups), _SCALES)).T)  # [groups, N]
        zero = None
        if not sch.sym:
            words = np.asarray(m.get("weight_zero_point", (n * sch.bits // 32, groups), _INT32))  # packed along N
            zero = np.ascontiguousarray(_unpack(np.ascontiguousarray(words.T), sch.bits))  # [groups, N]
        words = np.ascontiguousarray(np.asarray(packed).T)  # [K * bits / 32, N]: the same words, packed along K
        g_idx = _g_idx(m, "weight_g_idx", k, group)
        return PackedIntWeight(words, scale, zero, g_idx, sch.bits, group, (k, n), dtype)

    return (n, k), "weight_packed", build


def _fp8_tensor(m: _Module) -> tuple[tuple[int, int], str, Callable]:
    sch = m.sch
    weight = m.get("weight", dtypes=(_FP8,))
    n, k = weight.shape

    def build(dtype):
        q = np.ascontiguousarray(np.asarray(weight).T)  # [K, N]
        suffix = "weight_scale_inv" if m.has("weight_scale_inv") else "weight_scale"
        scale = np.asarray(m.get(suffix, dtypes=_SCALES), np.float32)
        if scale.size == 1:  # per tensor
            return QuantizedWeight(q, np.full((n,), scale.reshape(()), np.float32))
        if sch.block is not None:  # tiles [ceil(N / bn), ceil(K / bk)]
            bn, bk = sch.block
            m.get(suffix, (-(-n // bn), -(-k // bk)))
            return BlockFP8Weight(q, np.ascontiguousarray(scale.T), (bk, bn), (k, n), dtype)
        if scale.shape in ((n,), (n, 1)):  # per output channel
            return QuantizedWeight(q, scale.reshape(n))
        raise WeightError(f"tensor {m.name(suffix)!r} has shape {scale.shape}, expected [], [1], [{n}] or [{n}, 1]")

    return (n, k), "weight", build


_LAYOUTS = {  # layout -> (the tensor marking a quantized module, its reader)
    "gptq": ("qweight", _gptq_tensor),
    "awq": ("qweight", _awq_tensor),
    "pack": ("weight_packed", _pack_tensor),
    "fp8": ("weight", _fp8_tensor),
}


def _is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' "re:" patterns match the module name; other entries match it or one of its parts (as
    transformers' modules_to_not_convert, e.g. "lm_head")."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern) or pattern in module.split("."):
            return True
    return False


def view(ck: HFCheckpoint, sch: QuantScheme) -> tuple[Callable[[str], Any], Callable[[str], bool]]:
    """(get, has) over the checkpoint for the weight map: a quantized module's "<module>.weight" is a
    `QuantizedTensor`; every other name reads the checkpoint as it is."""
    marker, reader = _LAYOUTS[sch.layout]

    def quantized_module(name: str) -> _Module | None:
        if not name.endswith(".weight"):
            return None
        module = name.removesuffix(".weight")
        m = _Module(ck, module + ".", sch)
        stored = m.has(marker) and (sch.layout != "fp8" or ck.get(m.name(marker)).dtype == _FP8)
        if stored and _is_ignored(module, sch.ignore):
            raise WeightError(f"module {module!r} is in the quantization ignore list but stored quantized")
        return m if stored else None

    def has(name: str) -> bool:
        return quantized_module(name) is not None or ck.has(name)

    def get(name: str) -> Any:
        m = quantized_module(name)
        if m is None:
            return ck.get(name)
        shape, stored, build = reader(m)
        return QuantizedTensor(name, shape, m.name(stored), sch.describe(), build)

    return get, has
