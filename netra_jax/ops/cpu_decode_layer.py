"""One decoder layer of a decode-sized step as one CPU call: the kernel in `cpu_decode_layer.cc` (built by
`netra_jax.ops.cpu_kernels`), which `models.transformer` runs in place of its jnp layer (the reference) on CPU.

At decode sizes a layer in XLA is about ten small programs (norms, projections, RoPE, the KV write, attention,
activation, residuals), each paying a dispatch and a thread-pool wake-up; the kernel runs them as the phases of one
call on the calling thread and XLA's intra-op pool, its matmuls walking each weight once for all rows. It takes
float32 dense layers with the q, k and v projections joined (`models.transformer.fuse_qkv`, the CPU engine's layout),
float32 pages, up to ROWS_MAX tokens, every token attending per token (keys of this step's earlier tokens included),
and float32 LoRA adapter slots (`netra_jax.models.lora`: each token's delta through its own slot's factors);
everything else (quantized weights or pages, mixture-of-experts layers, hooks, tensor parallelism, prefill-sized
steps) runs the jnp layer. Not differentiable: gradients take the "xla" matmul backend's jnp layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.config import ModelConfig
from netra_jax.ops import cpu_kernels

LayerLoRA = dict[str, tuple[jax.Array, jax.Array]]  # models.lora's: {group: (a [in, S, R], b [S, R, out])}
LORA_GROUPS = ("qkv", "o", "gate_up", "down")  # the kernel's order of the adapter groups (models.lora.GROUPS)

__all__ = ["ROWS_MAX", "TARGET", "decode_layer", "takes"]

TARGET = "netra_decode_layer_f32"
ROWS_MAX = 32  # tokens per step: decode batches and speculative runs; prefill-sized steps keep XLA's layer

_WEIGHTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")
_OPTIONAL = ("bqkv", "bo", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "sinks")


def _f32(a) -> bool:
    return isinstance(a, jax.Array | np.ndarray) and a.dtype == jnp.float32


def takes(lp: dict, cfg: ModelConfig, i: int, k_pages, num_tokens: int, lora: LayerLoRA | None = None) -> bool:
    """Whether layer i with parameters lp, pages k_pages and adapter slots lora runs as one kernel call for a step of
    num_tokens: a dense layer of float32 arrays in the joined-qkv layout, float32 pages and adapter factors,
    1..ROWS_MAX tokens, and the kernels built. The kernel's layer is the sequential RMSNorm one with a gated MLP and
    RoPE: LayerNorm, parallel-residual, learned-position and ungated-MLP models run the jnp layer."""
    if not 0 < num_tokens <= ROWS_MAX or cfg.is_moe_layer(i) or not _f32(k_pages):
        return False
    if cfg.norm_kind != "rmsnorm" or cfg.parallel_residual or cfg.position_embedding != "rope" or not cfg.gated_mlp:
        return False
    if lora is not None and not all(_f32(f) for pair in lora.values() for f in pair):
        return False
    if not all(_f32(lp.get(k)) for k in _WEIGHTS) or any(k in lp and not _f32(lp[k]) for k in _OPTIONAL):
        return False
    if lp["w_gate_up"].ndim != 3 or cfg.hidden_act not in ("silu", "gelu_tanh"):
        return False
    return cpu_kernels.available()


def decode_layer(
    x: jax.Array,
    lp: dict,
    k_pages: jax.Array,
    v_pages: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    q_pos: jax.Array,
    valid: jax.Array,
    rows: jax.Array,
    lora: tuple[LayerLoRA, jax.Array] | None = None,
    *,
    cfg: ModelConfig,
    i: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer i of the model for the step's tokens: x [T, hidden] float32 -> (x after the layer, k_pages, v_pages
    with the tokens' keys and values written; the pages are updated in place when donated).

    cos, sin: [T, rotary_dim // 2] the tokens' RoPE tables for this layer (`models.rope.rope_tables`);
    slot_mapping: [T] int32 KV slot of each token (out of range: not written); q_pos, valid: [T] each token's position
    and whether it is real; rows: [T, max_pages] int32 each token's block-table row; lora: (this layer's adapter
    slots, {group: (a [in, S, R], b [S, R, out])}, each token's slot [T] int32, -1: none) or None. Arguments `takes`
    accepts."""
    hidden, D = cfg.hidden_size, cfg.head_dim
    none = jnp.zeros((0, 0, 0), jnp.float32)  # a group without adapters
    groups, lora_slots = ({}, jnp.zeros((x.shape[0],), jnp.int32)) if lora is None else lora
    factors = [f for g in LORA_GROUPS for f in groups.get(g, (none, none))]
    ones = jnp.ones((hidden,), jnp.float32)

    def opt(name, shape, fill):
        return lp[name] if name in lp else jnp.full(shape, fill, jnp.float32)

    outs = (
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        jax.ShapeDtypeStruct(k_pages.shape, jnp.float32),
        jax.ShapeDtypeStruct(v_pages.shape, jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGET, outs, vmap_method="sequential", input_output_aliases={8: 1, 9: 2})
    window = cfg.layer_window(i)
    return call(
        x.astype(jnp.float32),
        lp["attn_norm"],
        lp["wqkv"],
        opt("bqkv", (lp["wqkv"].shape[1],), 0.0),
        opt("q_norm", (D,), 1.0),
        opt("k_norm", (D,), 1.0),
        cos,
        sin,
        k_pages,
        v_pages,
        slot_mapping.astype(jnp.int32),
        q_pos.astype(jnp.int32),
        valid,
        rows.astype(jnp.int32),
        opt("sinks", (cfg.num_heads,), 0.0).reshape(cfg.num_heads),
        lp["wo"],
        opt("bo", (hidden,), 0.0),
        lp.get("post_attn_norm", ones),
        lp["mlp_norm"],
        lp["w_gate_up"],
        lp["w_down"],
        lp.get("post_mlp_norm", ones),
        lora_slots.astype(jnp.int32),
        *factors,
        eps=np.float32(cfg.rms_norm_eps),
        scale=np.float32(cfg.attn_scale),
        soft_cap=np.float32(cfg.attn_logit_softcap or 0.0),
        window=int(window or 0),
        has_sinks="sinks" in lp,
        act=0 if cfg.hidden_act == "silu" else 1,
        qk_norm=bool(cfg.qk_norm),
        sandwich=bool(cfg.sandwich_norms),
        rotary_dim=int(cfg.rotary_dim),
    )
