"""Tensor parallelism over a one-axis `jax.sharding` mesh ("tp"): the mesh, Megatron-style PartitionSpecs of every
parameter and of the paged KV cache, the head-parallel attention wrapper and the sharded (slice-reading) HF loader.

Layout (weights are stored [in, out], see `models.transformer`):
    wq/wk/wv [hidden, heads*head_dim] and their biases: column split by heads; wo [q_heads*head_dim, hidden]: row
    split (XLA all-reduces its partial sums); w_gate_up [hidden, 2, intermediate]: split on intermediate; w_down
    [intermediate, hidden]: row split (all-reduce); embed [vocab, hidden] and lm_head [hidden, vocab]: split on vocab
    (the lookup is a masked local gather plus an all-reduce, the logits are all-gathered), replicated when the
    vocabulary does not divide by tp; norms, q/k norms and the wo bias: replicated. KV cache [pages, page_size,
    kv_heads, head_dim]: split on kv_heads, so attention runs per device on its own heads without moving KV.
When num_kv_heads < tp (tp a multiple of it) every KV head is replicated tp / num_kv_heads times, as vLLM does:
the parameters and cache carry tp "expanded" KV heads (`shard_config`), one per device, each a copy of the head its
query heads use, so a device stores one KV head instead of all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from netra_jax.config import ConfigError, ModelConfig

TP = "tp"
HEADS = P(None, TP, None)  # [T, heads, head_dim] activations
KV_PAGES = P(None, None, TP, None)  # [num_pages, page_size, kv_heads, head_dim]

# parameter name -> PartitionSpec (vocab-split names are resolved in `param_specs`)
_LAYER_SPECS = {
    "wq": P(None, TP),
    "wk": P(None, TP),
    "wv": P(None, TP),
    "bq": P(TP),
    "bk": P(TP),
    "bv": P(TP),
    "wo": P(TP, None),
    "w_gate_up": P(None, None, TP),
    "w_down": P(TP, None),
}


# ------------------------------------------------------------------------------------------ mesh and config
def make_mesh(tp: int, devices=None) -> Mesh:
    """A ("tp",) mesh over the first `tp` devices (in `jax.devices()` order, so device 0 is the one the sampler and
    other single-device code use), automatic axis type so XLA propagates shardings through the forward."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (TP,), axis_types=(AxisType.Auto,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ConfigError when the model cannot be split `tp` ways."""
    if tp == 1:
        return
    kh = cfg.num_kv_heads
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads} is not divisible by it")
    if kh % tp and tp % kh:
        problems.append(f"num_kv_heads={kh} neither divides by it nor divides it")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
    if problems:
        raise ConfigError(f"tensor_parallel_size={tp} does not fit the model: {'; '.join(problems)}")


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the tp-way split stores (1 unless num_kv_heads < tp)."""
    return max(1, tp // cfg.num_kv_heads)


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded forward runs with: KV heads expanded to tp when there are fewer of them than tp."""
    check_tp(cfg, tp)
    r = kv_replicas(cfg, tp)
    return cfg if r == 1 else cfg.replace(num_kv_heads=cfg.num_kv_heads * r)


def kv_bytes_per_page_per_device(cfg: ModelConfig, page_size: int, dtype, tp: int) -> int:
    """Bytes one KV page takes on each device (K and V, all layers) under a tp-way split."""
    heads = shard_config(cfg, tp).num_kv_heads // tp
    return 2 * cfg.num_layers * page_size * heads * cfg.head_dim * np.dtype(dtype).itemsize


# ------------------------------------------------------------------------------------------ shardings
def param_specs(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """PartitionSpec of every leaf of a parameter pytree (same structure as `params`)."""
    vocab = TP if cfg.vocab_size % tp == 0 else None
    specs: dict[str, Any] = {"embed": P(vocab, None), "lm_head": P(None, vocab), "final_norm": P()}
    specs["layers"] = [{k: _LAYER_SPECS.get(k, P()) for k in lp} for lp in params["layers"]]
    return specs


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_PAGES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def head_parallel(fn: Callable, mesh: Mesh) -> Callable:
    """Run fn(q, k, v, k_pages, v_pages, md) -> (o, k_pages, v_pages) on each device's own heads: q/k/v/o
    [T, heads, head_dim] and the pages are split on their heads axis, the metadata is replicated. Heads are
    independent, so no KV crosses devices, and a Pallas kernel (which XLA cannot partition) sees plain local arrays."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(HEADS, HEADS, HEADS, KV_PAGES, KV_PAGES, P()),
        out_specs=(HEADS, KV_PAGES, KV_PAGES),
        check_vma=False,
    )


def _expand_kv(lp: dict, cfg: ModelConfig, r: int) -> dict:
    """Repeat each KV head r times in wk/wv [hidden, kv*hd] and bk/bv [kv*hd] (host numpy)."""
    out = dict(lp)
    D = cfg.head_dim
    for k in ("wk", "wv", "bk", "bv"):
        if k in lp and lp[k].shape[-1] == cfg.kv_size:
            a = np.asarray(lp[k])
            a = a.reshape(a.shape[:-1] + (cfg.num_kv_heads, D))
            out[k] = np.repeat(a, r, axis=-2).reshape(a.shape[:-2] + (cfg.num_kv_heads * r * D,))
    return out


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place a full parameter pytree (numpy or jax arrays) on the mesh: KV heads expanded when needed, each leaf
    with its NamedSharding (a device receives only its slice). Already placed leaves are left where they are."""
    tp = tp_size(mesh)
    check_tp(cfg, tp)
    r = kv_replicas(cfg, tp)
    if r > 1:
        params = {**params, "layers": [_expand_kv(lp, cfg, r) for lp in params["layers"]]}
    specs = param_specs(params, cfg, tp)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


# ------------------------------------------------------------------------------------------ sharded HF loading
def _norm_index(idx: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for sl, n in zip(idx, shape, strict=True):
        a, b, step = sl.indices(n)
        if step != 1:
            raise ValueError("strided shard index")
        out.append(slice(a, b))
    return tuple(out)


class _Leaf:
    """One parameter built from HF tensors by `read(index) -> numpy slice`; `shape` is its global shape."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[tuple[slice, ...]], np.ndarray]):
        self.shape, self.read = shape, read


class ShardedHFReader:
    """Builds the parameter pytree of `models.weights.hf_to_params` directly on the mesh, reading from the
    memory-mapped safetensors only the bytes of each device's slice (transposes, gate/up stacking, KV-head
    expansion and Gemma norm folding applied to the slice). `reads` logs (hf_name, shape read, bytes) per read."""

    def __init__(self, get: Callable[[str], np.ndarray], has: Callable[[str], bool], cfg: ModelConfig, dtype):
        self.get, self.has, self.cfg, self.dtype = get, has, cfg, np.dtype(dtype)
        self.reads: list[tuple[str, tuple[int, ...], int]] = []

    # -- raw access
    def _tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        from netra_jax.models.weights import WeightError

        if not self.has(name):
            raise WeightError(f"checkpoint lacks tensor {name!r}")
        a = self.get(name)  # a memory-mapped view: slicing it reads only the slice's pages
        if tuple(a.shape) != shape:
            raise WeightError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a

    def _take(self, name: str, a: np.ndarray, idx: tuple) -> np.ndarray:
        out = np.array(a[idx])
        self.reads.append((name, out.shape, out.nbytes))
        return out

    # -- leaf kinds
    def plain(self, name: str, shape: tuple[int, ...], f32: bool = False) -> _Leaf:
        a = self._tensor(name, shape)

        def read(idx):
            x = self._take(name, a, idx).astype(np.float32 if f32 else self.dtype)
            return 1.0 + x if f32 and self.cfg.norm_weight_offset else x  # Gemma's (1 + w) norms, as hf_to_params

        return _Leaf(shape, read)

    def linear(self, name: str, n_out: int, n_in: int, out_map: np.ndarray | None = None) -> _Leaf:
        """HF [out, in] stored as [in, out]; out_map[j] = HF row of our column j (KV-head expansion)."""
        a = self._tensor(name, (n_out, n_in))
        shape = (n_in, n_out if out_map is None else len(out_map))

        def read(idx):
            i, o = idx
            rows = o if out_map is None else _as_index(out_map[o])
            return np.ascontiguousarray(self._take(name, a, (rows, i)).T).astype(self.dtype)

        return _Leaf(shape, read)

    def bias(self, name: str, n: int, out_map: np.ndarray | None = None) -> _Leaf:
        a = self._tensor(name, (n,))

        def read(idx):
            rows = idx[0] if out_map is None else _as_index(out_map[idx[0]])
            return self._take(name, a, (rows,)).astype(self.dtype)

        return _Leaf((n if out_map is None else len(out_map),), read)

    def gate_up(self, gate: str, up: str, inter: int, hidden: int) -> _Leaf:
        g, u = self._tensor(gate, (inter, hidden)), self._tensor(up, (inter, hidden))

        def read(idx):
            h, k, i = idx
            parts = [(gate, g), (up, u)][k]
            return np.stack(
                [np.ascontiguousarray(self._take(n, a, (i, h)).T).astype(self.dtype) for n, a in parts], axis=1
            )

        return _Leaf((hidden, 2, inter), read)

    # -- the pytree
    def leaves(self, tp: int) -> dict:
        """The `_Leaf` pytree for a tp-way split (mirrors `models.weights.hf_to_params`)."""
        from netra_jax.models.weights import WeightError

        cfg = self.cfg
        H, V, I, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
        qs, ks = cfg.q_size, cfg.kv_size
        r = kv_replicas(cfg, tp)
        kv_map = None
        if r > 1:  # our column j of expanded head e = j // D reads HF row (e // r) * D + j % D
            j = np.arange(ks * r)
            kv_map = (j // D) // r * D + j % D
        embed = self.plain("model.embed_tokens.weight", (V, H))
        if self.has("lm_head.weight") and not cfg.tie_word_embeddings:
            lm_head = self.linear("lm_head.weight", V, H)
        elif cfg.tie_word_embeddings:
            lm_head = self.linear("model.embed_tokens.weight", V, H)
        else:
            raise WeightError("checkpoint lacks 'lm_head.weight' and does not tie word embeddings")
        layers = []
        for li in range(cfg.num_layers):
            p = f"model.layers.{li}."
            lp = {
                "attn_norm": self.plain(p + "input_layernorm.weight", (H,), f32=True),
                "wq": self.linear(p + "self_attn.q_proj.weight", qs, H),
                "wk": self.linear(p + "self_attn.k_proj.weight", ks, H, kv_map),
                "wv": self.linear(p + "self_attn.v_proj.weight", ks, H, kv_map),
                "wo": self.linear(p + "self_attn.o_proj.weight", H, qs),
                "w_gate_up": self.gate_up(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", I, H),
                "w_down": self.linear(p + "mlp.down_proj.weight", H, I),
            }
            for short, name, dim, m in (
                ("bq", "q_proj", qs, None),
                ("bk", "k_proj", ks, kv_map),
                ("bv", "v_proj", ks, kv_map),
                ("bo", "o_proj", H, None),
            ):
                if self.has(p + f"self_attn.{name}.bias"):
                    lp[short] = self.bias(p + f"self_attn.{name}.bias", dim, m)
            if cfg.qk_norm:
                lp["q_norm"] = self.plain(p + "self_attn.q_norm.weight", (D,), f32=True)
                lp["k_norm"] = self.plain(p + "self_attn.k_norm.weight", (D,), f32=True)
            if cfg.sandwich_norms:
                lp["post_attn_norm"] = self.plain(p + "post_attention_layernorm.weight", (H,), f32=True)
                lp["mlp_norm"] = self.plain(p + "pre_feedforward_layernorm.weight", (H,), f32=True)
                lp["post_mlp_norm"] = self.plain(p + "post_feedforward_layernorm.weight", (H,), f32=True)
            else:
                lp["mlp_norm"] = self.plain(p + "post_attention_layernorm.weight", (H,), f32=True)
            layers.append(lp)
        final = self.plain("model.norm.weight", (H,), f32=True)
        return {"embed": embed, "lm_head": lm_head, "final_norm": final, "layers": layers}

    def load(self, mesh: Mesh) -> dict:
        """The parameter pytree as jax arrays placed with their NamedShardings on `mesh`."""
        tp = tp_size(mesh)
        check_tp(self.cfg, tp)
        leaves = self.leaves(tp)
        specs = param_specs(leaves, self.cfg, tp)

        def build(leaf: _Leaf, spec: P) -> jax.Array:
            return jax.make_array_from_callback(
                leaf.shape, NamedSharding(mesh, spec), lambda idx: leaf.read(_norm_index(idx, leaf.shape))
            )

        return jax.tree.map(build, leaves, specs, is_leaf=lambda x: isinstance(x, _Leaf))


def _as_index(rows: np.ndarray) -> slice | np.ndarray:
    """A contiguous run of row numbers as a slice (a plain strided read), otherwise the array (a gather)."""
    if rows.size and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return slice(int(rows[0]), int(rows[0]) + rows.size)
    return rows


def load_hf_sharded(get, has, cfg: ModelConfig, dtype, mesh: Mesh) -> dict:
    """Sharded parameters of a HF checkpoint (getter/has as `HFCheckpoint` gives them), each device reading its
    slices only."""
    return ShardedHFReader(get, has, cfg, dtype).load(mesh)
