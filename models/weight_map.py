"""The one weight map: per model family, a table of parameter <- Hugging Face tensor name(s), transform and
tensor-parallel partition spec, and the one builder every loader reads it through (dense, sliced per device, GGUF
via llama.cpp -> HF names, and the dummy loader's shapes).

Adding a family is one table here plus the forward's behaviour flags on `ModelConfig`; the table is picked by
`cfg.family`, the forward never is. Parameters are laid out as `models.transformer` documents (weights [in, out],
norms, sinks and the router bias float32, everything else in the model dtype)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from netra_jax.config import ModelConfig
from netra_jax.models import weight_reads as rd
from netra_jax.models.weight_reads import Leaf, Reads, Source, WeightError
from netra_jax.quant import QUANTIZABLE, shard_specs

__all__ = [
    "TP",
    "TABLES",
    "Entry",
    "Leaf",
    "WeightError",
    "WeightReader",
    "hf_names",
    "hf_shapes",
    "hf_to_params",
    "table",
    "kv_params",
    "param_specs",
]

TP = "tp"  # the mesh axis parameters are split over
VOCAB = "vocab"  # in a spec: split on TP when the vocabulary divides by it, else replicated

# transforms (models.weight_reads)
COPY, NORM, F32, LINEAR, CONV1D = "copy", "norm", "f32", "linear", "conv1d"
GATE_UP, EXPERTS_GATE_UP, EXPERTS_DOWN, DEINTERLEAVE = "gate_up", "experts_gate_up", "experts_down", "deinterleave"
# the parameters kept quantized: a GGUF file's GGML blocks, a quantized checkpoint's weights (read through
# quant.matmul, embedding_rows, models.moe)
KEPT_IN_BLOCKS = (*QUANTIZABLE, "lm_head", "embed")
# which layers an entry belongs to
ALL, DENSE, MOE = "all", "dense", "moe"
# layouts of a tensor holding q, k and v side by side along its outputs (`Entry.fused`)
QKV = "qkv"  # q, then k, then v (GPT-2's c_attn)
QKV_HEADS = "qkv_heads"  # per head [heads, 3, head_dim]: each head's q, k and v (GPT-NeoX's query_key_value)


@dataclass(frozen=True)
class Entry:
    """One parameter. `hf`: its HF tensor name pattern(s) ("{L}" = "model.layers.<i>.", "{i}" = the layer index
    <i> itself, "{e}" = expert index); `shape`: symbolic shape of each HF tensor (see `_dims`); `spec`: partition
    spec of the parameter."""

    param: str
    hf: tuple[str, ...]
    shape: tuple[str, ...]
    transform: str
    spec: tuple
    layers: str = ALL
    kv: bool = False  # its output axis is KV heads (repeated when num_kv_heads < tp)
    optional: bool = False  # loaded when the checkpoint has it (attention biases)
    tied: str | None = None  # read this tensor instead when cfg.tie_word_embeddings (lm_head)
    fused: tuple[str, int] | None = None  # (layout, part): the part (0 q, 1 k, 2 v) of a fused q/k/v tensor

    @property
    def per_layer(self) -> bool:
        return "{L}" in self.hf[0] or "{i}" in self.hf[0]


def _e(param, hf, shape, transform, spec=(), **kw) -> Entry:
    return Entry(param, (hf,) if isinstance(hf, str) else tuple(hf), tuple(shape), transform, tuple(spec), **kw)


GLOBALS = (
    _e("embed", "model.embed_tokens.weight", ("vocab", "hidden"), COPY, (VOCAB, None)),
    _e("lm_head", "lm_head.weight", ("vocab", "hidden"), LINEAR, (None, VOCAB), tied="model.embed_tokens.weight"),
    _e("final_norm", "model.norm.weight", ("hidden",), NORM),
)
ATTENTION = (
    _e("attn_norm", "{L}input_layernorm.weight", ("hidden",), NORM),
    _e("wq", "{L}self_attn.q_proj.weight", ("q", "hidden"), LINEAR, (None, TP)),
    _e("wk", "{L}self_attn.k_proj.weight", ("kv", "hidden"), LINEAR, (None, TP), kv=True),
    _e("wv", "{L}self_attn.v_proj.weight", ("kv", "hidden"), LINEAR, (None, TP), kv=True),
    _e("wo", "{L}self_attn.o_proj.weight", ("hidden", "q"), LINEAR, (TP, None)),
    _e("bq", "{L}self_attn.q_proj.bias", ("q",), COPY, (TP,), optional=True),
    _e("bk", "{L}self_attn.k_proj.bias", ("kv",), COPY, (TP,), kv=True, optional=True),
    _e("bv", "{L}self_attn.v_proj.bias", ("kv",), COPY, (TP,), kv=True, optional=True),
    _e("bo", "{L}self_attn.o_proj.bias", ("hidden",), COPY, optional=True),
)
QK_NORMS = (
    _e("q_norm", "{L}self_attn.q_norm.weight", ("head_dim",), NORM),
    _e("k_norm", "{L}self_attn.k_norm.weight", ("head_dim",), NORM),
)
SINKS = (_e("sinks", "{L}self_attn.sinks", ("heads",), F32, (TP,)),)  # split with the query heads
MLP_NORM = (_e("mlp_norm", "{L}post_attention_layernorm.weight", ("hidden",), NORM),)
SANDWICH_NORMS = (
    _e("post_attn_norm", "{L}post_attention_layernorm.weight", ("hidden",), NORM),
    _e("mlp_norm", "{L}pre_feedforward_layernorm.weight", ("hidden",), NORM),
    _e("post_mlp_norm", "{L}post_feedforward_layernorm.weight", ("hidden",), NORM),
)
DENSE_MLP = (
    _e(
        "w_gate_up",
        ("{L}mlp.gate_proj.weight", "{L}mlp.up_proj.weight"),
        ("inter", "hidden"),
        GATE_UP,
        (None, None, TP),
        layers=DENSE,
    ),
    _e("w_down", "{L}mlp.down_proj.weight", ("hidden", "inter"), LINEAR, (TP, None), layers=DENSE),
)


def linear_experts(block: str, router: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """Experts stored as one torch Linear per expert and projection, under `{L}<block>.experts.<e>.`."""
    x = "{L}" + block + ".experts.{e}."
    return (
        _e("router", "{L}" + f"{block}.{router}.weight", ("experts", "hidden"), LINEAR, layers=MOE),
        _e(
            "experts_gate_up",
            (x + gate + ".weight", x + up + ".weight"),
            ("moe_inter", "hidden"),
            EXPERTS_GATE_UP,
            (None, None, None, TP),
            layers=MOE,
        ),
        _e("experts_down", x + down + ".weight", ("hidden", "moe_inter"), EXPERTS_DOWN, (None, TP, None), layers=MOE),
    )


GPT_OSS_EXPERTS = (  # fused expert tensors, already [in, out]; gate_up interleaves gate and up columns
    _e("router", "{L}mlp.router.weight", ("experts", "hidden"), LINEAR, layers=MOE),
    _e("router_bias", "{L}mlp.router.bias", ("experts",), F32, layers=MOE),
    _e(
        "experts_gate_up",
        "{L}mlp.experts.gate_up_proj",
        ("experts", "hidden", "2moe_inter"),
        DEINTERLEAVE,
        (None, None, None, TP),
        layers=MOE,
    ),
    _e(
        "experts_gate_up_bias",
        "{L}mlp.experts.gate_up_proj_bias",
        ("experts", "2moe_inter"),
        DEINTERLEAVE,
        (None, None, TP),
        layers=MOE,
    ),
    _e(
        "experts_down",
        "{L}mlp.experts.down_proj",
        ("experts", "moe_inter", "hidden"),
        COPY,
        (None, TP, None),
        layers=MOE,
    ),
    _e("experts_down_bias", "{L}mlp.experts.down_proj_bias", ("experts", "hidden"), COPY, layers=MOE),
)


def fused_qkv(
    weight: str, bias: str, shape: tuple[str, str], transform: str, layout: str, **bias_kw
) -> tuple[Entry, ...]:
    """wq, wk, wv and bq, bk, bv read from one tensor holding q, k and v along its outputs (and one bias), laid out as
    `layout`; `shape`: the weight's stored shape, [out, in] (LINEAR) or [in, out] (CONV1D)."""
    parts = ("q", "k", "v")
    return tuple(
        _e("w" + t, weight, shape, transform, (None, TP), kv=k > 0, fused=(layout, k)) for k, t in enumerate(parts)
    ) + tuple(
        _e("b" + t, bias, ("qkv",), COPY, (TP,), kv=k > 0, fused=(layout, k), **bias_kw) for k, t in enumerate(parts)
    )


GPT2 = (  # Conv1D weights (stored [in, out]), learned positions, LayerNorms with biases, lm_head tied to wte
    _e("embed", "transformer.wte.weight", ("vocab", "hidden"), COPY, (VOCAB, None)),
    _e("pos_embed", "transformer.wpe.weight", ("positions", "hidden"), COPY),
    _e("lm_head", "lm_head.weight", ("vocab", "hidden"), LINEAR, (None, VOCAB), tied="transformer.wte.weight"),
    _e("final_norm", "transformer.ln_f.weight", ("hidden",), NORM),
    _e("final_norm_bias", "transformer.ln_f.bias", ("hidden",), F32),
    _e("attn_norm", "transformer.h.{i}.ln_1.weight", ("hidden",), NORM),
    _e("attn_norm_bias", "transformer.h.{i}.ln_1.bias", ("hidden",), F32),
    *fused_qkv(
        "transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_attn.bias", ("hidden", "qkv"), CONV1D, QKV
    ),
    _e("wo", "transformer.h.{i}.attn.c_proj.weight", ("q", "hidden"), CONV1D, (TP, None)),
    _e("bo", "transformer.h.{i}.attn.c_proj.bias", ("hidden",), COPY),
    _e("mlp_norm", "transformer.h.{i}.ln_2.weight", ("hidden",), NORM),
    _e("mlp_norm_bias", "transformer.h.{i}.ln_2.bias", ("hidden",), F32),
    _e("w_up", "transformer.h.{i}.mlp.c_fc.weight", ("hidden", "inter"), CONV1D, (None, TP)),
    _e("b_up", "transformer.h.{i}.mlp.c_fc.bias", ("inter",), COPY, (TP,)),
    _e("w_down", "transformer.h.{i}.mlp.c_proj.weight", ("inter", "hidden"), CONV1D, (TP, None)),
    _e("b_down", "transformer.h.{i}.mlp.c_proj.bias", ("hidden",), COPY),
)
_NEOX = "gpt_neox.layers.{i}."
GPT_NEOX = (  # per-head fused q/k/v, partial rotary, LayerNorms with biases; attention_bias false drops q/k/v/o's
    _e("embed", "gpt_neox.embed_in.weight", ("vocab", "hidden"), COPY, (VOCAB, None)),
    _e("lm_head", "embed_out.weight", ("vocab", "hidden"), LINEAR, (None, VOCAB), tied="gpt_neox.embed_in.weight"),
    _e("final_norm", "gpt_neox.final_layer_norm.weight", ("hidden",), NORM),
    _e("final_norm_bias", "gpt_neox.final_layer_norm.bias", ("hidden",), F32),
    _e("attn_norm", _NEOX + "input_layernorm.weight", ("hidden",), NORM),
    _e("attn_norm_bias", _NEOX + "input_layernorm.bias", ("hidden",), F32),
    *fused_qkv(
        _NEOX + "attention.query_key_value.weight",
        _NEOX + "attention.query_key_value.bias",
        ("qkv", "hidden"),
        LINEAR,
        QKV_HEADS,
        optional=True,
    ),
    _e("wo", _NEOX + "attention.dense.weight", ("hidden", "q"), LINEAR, (TP, None)),
    _e("bo", _NEOX + "attention.dense.bias", ("hidden",), COPY, optional=True),
    _e("mlp_norm", _NEOX + "post_attention_layernorm.weight", ("hidden",), NORM),
    _e("mlp_norm_bias", _NEOX + "post_attention_layernorm.bias", ("hidden",), F32),
    _e("w_up", _NEOX + "mlp.dense_h_to_4h.weight", ("inter", "hidden"), LINEAR, (None, TP)),
    _e("b_up", _NEOX + "mlp.dense_h_to_4h.bias", ("inter",), COPY, (TP,)),
    _e("w_down", _NEOX + "mlp.dense_4h_to_h.weight", ("hidden", "inter"), LINEAR, (TP, None)),
    _e("b_down", _NEOX + "mlp.dense_4h_to_h.bias", ("hidden",), COPY),
)

LLAMA = GLOBALS + ATTENTION + MLP_NORM + DENSE_MLP
GEMMA = GLOBALS + ATTENTION + SANDWICH_NORMS + DENSE_MLP
TABLES: dict[str, tuple[Entry, ...]] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA + QK_NORMS,
    "gemma2": GEMMA,
    "gemma3": GEMMA + QK_NORMS,
    "qwen3_moe": LLAMA + QK_NORMS + linear_experts("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "mixtral": GLOBALS + ATTENTION + MLP_NORM + linear_experts("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "gpt_oss": GLOBALS + ATTENTION + SINKS + MLP_NORM + GPT_OSS_EXPERTS,
    "gpt2": GPT2,
    "gpt_neox": GPT_NEOX,
}


def table(cfg: ModelConfig) -> tuple[Entry, ...]:
    if cfg.family not in TABLES:
        raise WeightError(f"no weight map for model family {cfg.family!r}; known: {', '.join(TABLES)}")
    return TABLES[cfg.family]


def _dims(cfg: ModelConfig) -> dict[str, int]:
    return {
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "inter": cfg.intermediate_size,
        "q": cfg.q_size,
        "kv": cfg.kv_size,
        "qkv": cfg.q_size + 2 * cfg.kv_size,
        "positions": cfg.max_position_embeddings,
        "head_dim": cfg.head_dim,
        "heads": cfg.num_heads,
        "experts": cfg.num_experts,
        "moe_inter": cfg.moe_intermediate_size,
        "2moe_inter": 2 * cfg.moe_intermediate_size,
    }


def _in_layer(entry: Entry, cfg: ModelConfig, i: int) -> bool:
    return entry.layers == ALL or (entry.layers == MOE) == cfg.is_moe_layer(i)


def hf_names(entry: Entry, cfg: ModelConfig, layer: int | None) -> list[list[str]]:
    """HF names of each pattern of the entry: one per expert for "{e}" patterns, else one."""
    prefix = "" if layer is None else f"model.layers.{layer}."
    experts = range(cfg.num_experts)
    return [
        [p.format(L=prefix, i=layer, e=e) for e in experts] if "{e}" in p else [p.format(L=prefix, i=layer)]
        for p in entry.hf
    ]


def fused_columns(layout: str, part: int, cfg: ModelConfig) -> np.ndarray:
    """Source output index of each output of part `part` (0 q, 1 k, 2 v) of a fused q/k/v tensor in `layout`."""
    sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    if layout == QKV:
        return sum(sizes[:part]) + np.arange(sizes[part])
    if layout != QKV_HEADS:
        raise ValueError(f"unknown fused q/k/v layout {layout!r}")
    if cfg.num_kv_heads != cfg.num_heads:
        raise WeightError(
            f"a per-head fused q/k/v tensor needs as many KV heads as query heads, not {cfg.num_kv_heads}"
        )
    head, j = np.divmod(np.arange(cfg.q_size), cfg.head_dim)
    return (3 * head + part) * cfg.head_dim + j


def _entries(cfg: ModelConfig):
    """(entry, layer or None) for every parameter of the model: the globals, then each layer's."""
    tab = table(cfg)
    for entry in tab:
        if not entry.per_layer:
            yield entry, None
    for i in range(cfg.num_layers):
        for entry in tab:
            if entry.per_layer and _in_layer(entry, cfg, i):
                yield entry, i


def hf_shapes(cfg: ModelConfig, optional: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of a checkpoint of this config (the dummy loader's stand-in checkpoint); `optional`
    names the optional parameters it carries (e.g. ("bq", "bk", "bv"))."""
    dims = _dims(cfg)
    out = {}
    for entry, layer in _entries(cfg):
        if entry.optional and entry.param not in optional:
            continue
        if entry.tied and cfg.tie_word_embeddings:
            continue
        for names in hf_names(entry, cfg, layer):
            out |= {n: tuple(dims[d] for d in entry.shape) for n in names}
    return out


def kv_params(cfg: ModelConfig) -> tuple[str, ...]:
    """Parameters whose output axis is KV heads (repeated when tensor parallelism has more devices than heads)."""
    return tuple(dict.fromkeys(e.param for e in table(cfg) if e.kv))


def param_specs(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """PartitionSpec of every leaf of a parameter pytree (same structure as `params`), from the table. A quantized
    weight (or a `weight_reads.BlocksLeaf` to become one) gets its arrays' specs (`quant.shard_specs`: WeightError
    naming it when its blocks cannot be split so)."""
    vocab = TP if cfg.vocab_size % tp == 0 else None
    specs = {e.param: P(*(vocab if s == VOCAB else s for s in e.spec)) for e in table(cfg)}

    def spec(name: str, value, path: str):
        if name not in specs:
            raise WeightError(f"parameter {name!r} is not in the {cfg.family} weight map")
        weight = value.template if isinstance(value, rd.BlocksLeaf) else value
        try:
            return shard_specs(weight, specs[name], tp, path)
        except ValueError as e:
            raise WeightError(str(e)) from None

    out: dict[str, Any] = {k: spec(k, v, k) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: spec(k, v, f"layers.{i}.{k}") for k, v in lp.items()} for i, lp in enumerate(params["layers"])]
    return out


Getter = Callable[[str], Any]


def _grid(sources: list[Source], shape: tuple[int, ...]) -> np.ndarray:
    """`sources` as a numpy object array of `shape` (-1: as many as there are), for `weight_reads.blocks`."""
    grid = np.empty(len(sources), object)
    grid[:] = sources
    return grid.reshape(shape)


class WeightReader:
    """Builds the parameter pytree of a checkpoint as `Leaf`s from the family's table: `get(name)` gives a tensor
    (numpy array or sliceable view) by HF name, `has(name)` says whether the checkpoint has it. `reads` logs every
    slice read (see `weight_reads.Reads`). `without`: parameters left out (never read), e.g. ("lm_head",) for an
    embedding model, whose checkpoint may have none. `keep_quantized`: the parameters of KEPT_IN_BLOCKS whose
    sources offer GGML blocks (a GGUF file's kept formats) or a quantized form (`loader.hf_quant`) become
    `rd.KeptLeaf`s, kept quantized."""

    def __init__(
        self,
        cfg: ModelConfig,
        get: Getter,
        has: Callable[[str], bool],
        dtype,
        without: Collection[str] = (),
        keep_quantized: bool = False,
    ):
        self.cfg, self.get, self.has, self.dtype = cfg, get, has, np.dtype(dtype)
        self.without = frozenset(without)
        self.keep_quantized = keep_quantized
        self.reads = Reads()
        self._dims = _dims(cfg)

    def _source(self, name: str, shape: tuple[str, ...]) -> Source:
        if not self.has(name):
            raise WeightError(f"checkpoint lacks tensor {name!r}")
        a = self.get(name)
        want = tuple(self._dims[d] for d in shape)
        if tuple(a.shape) != want:
            stored = getattr(a, "stored", name)  # a quantized tensor's size is read from its packed tensor
            what = f"tensor {name!r}" if stored == name else f"tensor {stored!r} (read as {name!r})"
            raise WeightError(f"{what} has shape {tuple(a.shape)}, expected {want}")
        return Source(name, a)

    def leaf(self, entry: Entry, layer: int | None, kv_map: np.ndarray | None = None) -> Leaf | None:
        """The entry's parameter at `layer` (None for a global), or None for an optional tensor the checkpoint
        lacks. `kv_map`: source row of each output row of KV-head parameters."""
        cfg, dt, f32 = self.cfg, self.dtype, np.dtype(np.float32)
        names = hf_names(entry, cfg, layer)
        if entry.tied and cfg.tie_word_embeddings:
            names = [[entry.tied]]
        elif entry.optional and not self.has(names[0][0]):
            return None
        elif entry.tied and not self.has(names[0][0]):
            raise WeightError(
                f"checkpoint lacks {names[0][0]!r} and does not tie word embeddings (a model without a language-model "
                "head, such as an embedding checkpoint, is served with --task embed)"
            )
        src = [[self._source(n, entry.shape) for n in group] for group in names]
        out_map = kv_map if entry.kv else None  # source output of each output (None: the same one)
        if entry.fused is not None:
            part = fused_columns(*entry.fused, cfg)
            out_map = part if out_map is None else part[out_map]
        one = src[0][0]
        t = entry.transform
        if self.keep_quantized and out_map is None and (kept := self._kept(entry, src)) is not None:
            return kept
        if t == COPY:
            return rd.copy(one, self.reads, dt, out_map)
        if t == NORM:
            return rd.copy(one, self.reads, f32, offset=1.0 if cfg.norm_weight_offset else 0.0)
        if t == F32:
            return rd.copy(one, self.reads, f32)
        if t == LINEAR:
            return rd.linear(one, self.reads, dt, out_map)
        if t == CONV1D:
            return rd.conv1d(one, self.reads, dt, out_map)
        if t == GATE_UP:
            return rd.gate_up(one, src[1][0], self.reads, dt)
        if t == EXPERTS_GATE_UP:
            return rd.experts_gate_up(src[0], src[1], self.reads, dt)
        if t == EXPERTS_DOWN:
            return rd.experts_down(src[0], self.reads, dt)
        if t == DEINTERLEAVE:
            return rd.deinterleave(one, self.reads, dt)
        raise ValueError(f"unknown transform {t!r}")

    def _kept(self, entry: Entry, src: list[list[Source]]) -> rd.KeptLeaf | rd.BlocksLeaf | None:
        """The entry kept quantized, or None (read as floats): a Linear weight or gate and up whose sources offer a
        quantized checkpoint's form of one format (`rd.quantized`), or a Linear weight, gate and up, per-expert
        Linear weights or the embedding table whose sources offer GGML blocks of one format (`rd.blocks`)."""
        flat = [s for group in src for s in group]
        if entry.param not in KEPT_IN_BLOCKS:
            return None  # e.g. a MoE router: read as floats by the router's own dot
        if rd.has_quantized(flat) and entry.transform in (LINEAR, GATE_UP):
            rows, k = flat[0].a.shape
            shape = (k, rows) if entry.transform == LINEAR else (k, 2, rows)
            return rd.quantized(flat, self.reads, shape, self.dtype)
        if not rd.has_blocks(flat):
            return None
        grids = {  # the sources' layout, leading the data's rows: its output axes (and experts) before each row
            LINEAR: lambda: _grid([src[0][0]], ()),
            GATE_UP: lambda: _grid([src[0][0], src[1][0]], (2,)),
            EXPERTS_GATE_UP: lambda: _grid([s for pair in zip(src[0], src[1], strict=True) for s in pair], (-1, 2)),
            EXPERTS_DOWN: lambda: _grid(src[0], (-1,)),
        }
        if entry.param == "embed":
            return rd.blocks(_grid([src[0][0]], ()), self.reads, False, self.dtype)
        if entry.transform not in grids:
            return None
        batch_dims = 1 if entry.transform in (EXPERTS_GATE_UP, EXPERTS_DOWN) else 0
        return rd.blocks(grids[entry.transform](), self.reads, True, self.dtype, batch_dims)

    def leaves(self, kv_replicas: int = 1) -> dict:
        """The `Leaf` pytree {embed, lm_head, final_norm, layers: [dict, ...]}; KV heads repeated `kv_replicas`
        times (tensor parallelism over more devices than KV heads)."""
        cfg = self.cfg
        kv_map = rd.kv_row_map(cfg.num_kv_heads, cfg.head_dim, kv_replicas)
        out: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
        for entry, layer in _entries(cfg):
            if entry.param in self.without:
                continue
            leaf = self.leaf(entry, layer, kv_map)
            if leaf is not None:
                (out if layer is None else out["layers"][layer])[entry.param] = leaf
        return out


def hf_to_params(
    cfg: ModelConfig, get: Getter, has: Callable[[str], bool], dtype, without: Collection[str] = ()
) -> dict:
    """The whole parameter pytree as numpy arrays, from HF-named tensors (each leaf read block by block into its
    array: `weight_reads.Leaf.read`); `without` as `WeightReader`'s."""
    leaves = WeightReader(cfg, get, has, dtype, without).leaves()
    return {
        **{k: v.read_all() for k, v in leaves.items() if k != "layers"},
        "layers": [{k: v.read_all() for k, v in lp.items()} for lp in leaves["layers"]],
    }
