"""llama.cpp (GGUF) tensor names -> the Hugging Face names of the weight map: each GGUF tensor is routed to the
parameter it feeds and the family's table (`models.weight_map`) names the HF tensor(s), so a GGUF file is read
through the same table as a HF directory.

llama.cpp's converter (convert_hf_to_gguf.py) changes some layouts, undone here lazily: a tensor is de-quantized
when the weight map reads it, and only the leading-axis range (rows, experts) the read covers, so a large parameter
read in blocks de-quantizes one block at a time. Merged expert tensors `ffn_{gate,up,down}_exps` [E, out, in]
are split per expert for families storing one Linear per expert (Qwen3-MoE, Mixtral) or transposed to [E, in, out]
(gpt-oss, whose gate and up halves are handed to the weight map as `weight_reads.Interleaved`, the interleaved
`gate_up_proj` they stand for, read without building it); a fused `ffn_gate_up_exps` holds the gate rows then the
up rows; old Mixtral files store `blk.N.ffn_gate.<expert>.weight` per expert; Llama-arch
Q/K rows are un-permuted (llama.cpp's interleaved-pair RoPE); Gemma's norms, stored as 1 + w, get 1 subtracted;
GPT-2's Conv1D weights, stored [out, in] like every Linear, are transposed back to [in, out]; a fused q/k/v
tensor (`attn_qkv`) holds q, k and v one after another, which GPT-NeoX's checkpoints interleave per head.

A 2-D tensor in a GGML block format the runtime keeps quantized (`ops.ggml_blocks.FORMATS`) also offers its raw
rows (`LazyTensor.blocks`), through the row permutations and halves above (whole rows of blocks move unchanged), so
the weight map can keep it as it is in the file."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from netra_jax.config import ModelConfig
from netra_jax.loader import gguf_loader
from netra_jax.loader.errors import CheckpointError
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.models import weight_map
from netra_jax.models.weight_reads import Interleaved
from netra_jax.ops.ggml_blocks import FORMATS

FUSED = -1  # a gate_up tensor holding both parts: gate rows, then up rows
# llama.cpp tensor -> (parameters it may feed: the first one the family's table has, part of that parameter, or one
# part per parameter)
_GLOBAL = {
    "token_embd.weight": (("embed",), 0),
    "position_embd.weight": (("pos_embed",), 0),
    "output_norm.weight": (("final_norm",), 0),
    "output_norm.bias": (("final_norm_bias",), 0),
    "output.weight": (("lm_head",), 0),
}
_BLOCK = {
    "attn_norm.weight": (("attn_norm",), 0),
    "attn_norm.bias": (("attn_norm_bias",), 0),
    "attn_qkv.weight": (("wq",), 0),  # q, k and v rows one after another: the fused tensor wq, wk and wv read
    "attn_qkv.bias": (("bq",), 0),
    "attn_q.weight": (("wq",), 0),
    "attn_k.weight": (("wk",), 0),
    "attn_v.weight": (("wv",), 0),
    "attn_output.weight": (("wo",), 0),
    "attn_q.bias": (("bq",), 0),
    "attn_k.bias": (("bk",), 0),
    "attn_v.bias": (("bv",), 0),
    "attn_output.bias": (("bo",), 0),
    "attn_q_norm.weight": (("q_norm",), 0),
    "attn_k_norm.weight": (("k_norm",), 0),
    "attn_sinks.weight": (("sinks",), 0),
    "ffn_norm.weight": (("mlp_norm",), 0),  # the pre-MLP norm (Gemma 3's pre_feedforward_layernorm)
    "ffn_norm.bias": (("mlp_norm_bias",), 0),
    "post_attention_norm.weight": (("post_attn_norm", "mlp_norm"), 0),  # gpt-oss: its pre-MLP norm
    "post_ffw_norm.weight": (("post_mlp_norm",), 0),
    "ffn_gate.weight": (("w_gate_up",), 0),
    "ffn_up.weight": (("w_gate_up", "w_up"), (1, 0)),
    "ffn_down.weight": (("w_down",), 0),
    "ffn_up.bias": (("b_up",), 0),
    "ffn_down.bias": (("b_down",), 0),
    "ffn_gate_inp.weight": (("router",), 0),
    "ffn_gate_inp.bias": (("router_bias",), 0),
    "ffn_gate_exps.weight": (("experts_gate_up",), 0),
    "ffn_up_exps.weight": (("experts_gate_up",), 1),
    "ffn_gate_up_exps.weight": (("experts_gate_up",), FUSED),
    "ffn_down_exps.weight": (("experts_down",), 0),
    "ffn_gate_exps.bias": (("experts_gate_up_bias",), 0),
    "ffn_up_exps.bias": (("experts_gate_up_bias",), 1),
    "ffn_gate_up_exps.bias": (("experts_gate_up_bias",), FUSED),
    "ffn_down_exps.bias": (("experts_down_bias",), 0),
}
_PER_EXPERT = {  # old Mixtral files: blk.N.<kind>.<expert>.weight
    "ffn_gate": ("experts_gate_up", 0),
    "ffn_up": ("experts_gate_up", 1),
    "ffn_down": ("experts_down", 0),
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+\.(?:weight|bias))")
_EXPERT_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(\d+)\.weight")


@dataclass
class LazyTensor:
    """A tensor built when read: `shape`, and `make(rows)` -> the numpy array of the leading-axis range `rows` (a
    step-1 slice), built then and not kept, so a loader holds only the block it is converting."""

    shape: tuple[int, ...]
    make: Callable[[slice], np.ndarray]
    # a 2-D tensor in a kept GGML format: its raw rows [rows, row_bytes] of a leading range, and the format's name
    blocks: Callable[[slice], np.ndarray] | None = None
    qtype: str | None = None

    def __getitem__(self, idx: tuple[slice | np.ndarray, ...]) -> np.ndarray:
        """`idx`: a step-1 slice of the leading axis (as the weight map's readers take) or an index array (a fused
        tensor's part: the range covering it is read), then any index of the rest."""
        lead, rest = idx[0], idx[1:]
        if isinstance(lead, np.ndarray) and lead.ndim == 1 and lead.size:
            lo = int(lead.min())
            return self.make(slice(lo, int(lead.max()) + 1))[(lead - lo, *rest)]
        if not isinstance(lead, slice) or lead.step not in (None, 1):
            raise TypeError(f"a lazy GGUF tensor reads step-1 slices of its leading axis, not {lead!r}")
        start, stop, _ = lead.indices(self.shape[0])
        return self.make(slice(start, max(start, stop)))[(slice(None), *rest)]


def _block(gf: GGUFFile, name: str, lead: tuple[int, ...] = ()) -> LazyTensor:
    """GGUF tensor `name` de-quantized, or only its sub-array [lead] (one expert), a range of leading rows at a
    time: quantized blocks run along the last axis, so leading indices select whole blocks (a 1-D tensor is one
    row of blocks: de-quantized whole)."""
    info = gf.tensors[name]
    shape = info.shape[len(lead) :]
    what = f"{gf.path}: tensor {name!r}"

    def make(rows: slice) -> np.ndarray:
        if len(shape) == 1:
            return gguf_loader.dequantize(gf.raw(name)[lead], info.qtype, shape, what)[rows]
        raw = gf.raw(name)[(*lead, rows)]
        return gguf_loader.dequantize(raw, info.qtype, (raw.shape[0], *shape[1:]), what)

    if len(shape) != 2 or info.qtype.name not in FORMATS:
        return LazyTensor(shape, make)
    return LazyTensor(shape, make, lambda rows: gf.raw(name)[(*lead, rows)], info.qtype.name)


RowsReader = Callable[[slice], np.ndarray]


def _on_rows(t: LazyTensor, op: Callable[[RowsReader], RowsReader], shape: tuple[int, ...] | None = None):
    """`t` with `op` (a rearrangement of whole rows: a reader of row ranges -> another) applied to its values and,
    when it has them, to its raw block rows; `shape`: the result's, when not t's."""
    return LazyTensor(shape or t.shape, op(t.make), t.blocks and op(t.blocks), t.qtype)


def _apply(t: LazyTensor, fn: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...] | None = None):
    """`fn` applied to each block read: `fn` must act on each leading index alone (elementwise, per-expert
    transposes, slices of other axes)."""
    return LazyTensor(shape or t.shape, lambda rows: fn(t.make(rows)))


def _swap_last(t: LazyTensor) -> LazyTensor:  # [E, out, in] -> [E, in, out]
    return _apply(t, lambda a: a.swapaxes(-1, -2), (*t.shape[:-2], t.shape[-1], t.shape[-2]))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama Q/K row permutation (interleaved-pair rope) back to HF's rotate-half layout.

    w: [n_heads * head_dim, ...] in llama.cpp order, where row h*hd + 2*j + s holds HF row h*hd + s*hd/2 + j."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"cannot un-permute {rows} rope rows over {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(t: LazyTensor, n_heads: int) -> LazyTensor:
    """`unpermute_rope_rows` of a lazy tensor: rows are permuted within each head, so a range of rows is read from
    the whole heads that cover it."""
    if t.shape[0] % (2 * n_heads):
        raise CheckpointError(f"cannot un-permute {t.shape[0]} rope rows over {n_heads} heads")
    hd = t.shape[0] // n_heads

    def op(read: RowsReader) -> RowsReader:
        def rows_of(rows: slice) -> np.ndarray:
            h0, h1 = rows.start // hd, max(-(-rows.stop // hd), rows.start // hd + 1)
            heads = unpermute_rope_rows(read(slice(h0 * hd, h1 * hd)), h1 - h0)
            return heads[rows.start - h0 * hd : rows.stop - h0 * hd]

        return rows_of

    return _on_rows(t, op)


def _transposed(t: LazyTensor) -> LazyTensor:
    """A 2-D tensor [out, in] as [in, out] (GPT-2's Conv1D layout): a range of its rows is columns of the file's
    tensor, read whole for it."""

    def make(rows: slice) -> np.ndarray:
        return np.ascontiguousarray(t.make(slice(0, t.shape[0]))[:, rows].T)

    return LazyTensor((t.shape[1], t.shape[0]), make)


def _per_head_qkv(t: LazyTensor, cfg: ModelConfig) -> LazyTensor:
    """A fused q/k/v tensor (rows, or a bias) stored q, k, v one after another, in GPT-NeoX's per-head order
    [heads, 3, head_dim]; its rows gathered from the whole tensor."""
    source = np.empty(t.shape[0], np.int64)  # file row of each per-head row
    for part in range(3):
        source[weight_map.fused_columns(weight_map.QKV_HEADS, part, cfg)] = weight_map.fused_columns(
            weight_map.QKV, part, cfg
        )
    return LazyTensor(t.shape, lambda rows: t.make(slice(0, t.shape[0]))[source[rows]])


class _Routes:
    """The GGUF tensors of each (parameter, layer, expert): part -> tensor name (FUSED: both parts)."""

    def __init__(self, gf: GGUFFile, table: dict[str, weight_map.Entry]):
        self.parts: dict[tuple[str, int | None, int | None], dict[int, str]] = {}
        for name in gf.tensors:
            layer = expert = None
            if name in _GLOBAL:
                params, part = _GLOBAL[name]
            elif m := _BLOCK_RE.fullmatch(name):
                layer, (params, part) = int(m.group(1)), _BLOCK.get(m.group(2), ((), 0))
            elif (m := _EXPERT_RE.fullmatch(name)) and m.group(2) in _PER_EXPERT:
                param, part = _PER_EXPERT[m.group(2)]
                layer, expert, params = int(m.group(1)), int(m.group(3)), (param,)
            else:
                continue  # e.g. rope_freqs: read by the config, not a parameter
            k = next((k for k, p in enumerate(params) if p in table), None)
            if k is not None:  # else a tensor this family's forward does not read
                part = part[k] if isinstance(part, tuple) else part
                self.parts.setdefault((params[k], layer, expert), {})[part] = name


def _halves(t: LazyTensor, axis: int) -> tuple[LazyTensor, LazyTensor]:
    """(gate, up) of a fused gate_up tensor: the first and second half of `axis` (the output rows)."""
    axis %= len(t.shape)
    n = t.shape[axis] // 2
    shape = (*t.shape[:axis], n, *t.shape[axis + 1 :])
    if axis == 0:  # the leading axis: a range of a half is a range of the whole, shifted

        def part(k: int) -> LazyTensor:
            def op(read: RowsReader) -> RowsReader:
                return lambda rows: read(slice(rows.start + k * n, rows.stop + k * n))

            return _on_rows(t, op, shape)

        return part(0), part(1)
    return tuple(
        _apply(t, lambda a, k=k: a[(slice(None),) * axis + (slice(k * n, (k + 1) * n),)], shape) for k in (0, 1)
    )


def hf_view(gf: GGUFFile, cfg: ModelConfig):
    """(get, has) over the HF tensor names of the family's weight map; `get` returns a `LazyTensor`."""
    table = {e.param: e for e in weight_map.table(cfg)}
    views: dict[str, LazyTensor] = {}
    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads, "bk": cfg.num_kv_heads}
    permuted = gf.architecture == "llama"

    def fix(t: LazyTensor, entry: weight_map.Entry, per_expert: bool) -> LazyTensor:
        if len(t.shape) == 3 and not per_expert:  # a fused expert weight: llama.cpp [E, out, in], HF [E, in, out]
            t = _swap_last(t)
        if permuted and entry.param in heads:
            t = _unpermuted(t, heads[entry.param])
        if entry.transform == weight_map.CONV1D and len(t.shape) == 2:
            t = _transposed(t)
        if entry.fused is not None and entry.fused[0] == weight_map.QKV_HEADS:
            t = _per_head_qkv(t, cfg)
        if entry.transform == weight_map.NORM and cfg.norm_weight_offset:
            t = _apply(t, lambda a: a - np.float32(1.0))
        return t

    for (param, layer, expert), parts in _Routes(gf, table).parts.items():
        entry = table[param]
        names = weight_map.hf_names(entry, cfg, layer)  # [pattern][expert] (one name when not per expert)
        if expert is not None:  # an old per-expert tensor
            for part, name in parts.items():
                views[names[part][expert]] = _block(gf, name)
            continue
        per_expert = len(names[0]) > 1
        for e, lead in enumerate([(e,) for e in range(len(names[0]))] if per_expert else [()]):
            if FUSED in parts:
                axis = -1 if parts[FUSED].endswith(".bias") else -2
                by_part = dict(enumerate(_halves(_block(gf, parts[FUSED], lead), axis)))
            else:
                by_part = {part: _block(gf, name, lead) for part, name in parts.items()}
            by_part = {part: fix(t, entry, per_expert) for part, t in by_part.items()}
            if len(names) > 1 or len(by_part) == 1:  # one HF tensor per part
                for part, t in by_part.items():
                    views[names[part][e]] = t
            else:  # both parts in one HF tensor: gpt-oss's interleaved gate/up, given as its halves
                views[names[0][0]] = Interleaved(by_part[0], by_part[1])
    return views.__getitem__, views.__contains__
