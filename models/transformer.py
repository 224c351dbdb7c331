"""Pure forward of the decoder-only families we serve (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Qwen3-MoE,
Mixtral, gpt-oss, GPT-2, GPT-NeoX) over a flat ragged token batch and the paged KV cache; no state outside the
arguments. Variant behaviour comes from `ModelConfig`'s flags, never from the family name.

Parameter pytree (weights stored [in, out] so activations multiply on the left; norms in float32):

    embed [vocab, hidden], lm_head [hidden, vocab] (absent when loaded for embedding only), final_norm [hidden],
    with norm_kind "layernorm": final_norm_bias [hidden] float32 (and each norm's "<norm>_bias" below),
    with position_embedding "learned": pos_embed [max_position_embeddings, hidden] (row p added at position p),
    layers: list of dicts with
        attn_norm [hidden], wq [hidden, q_heads*head_dim], wk/wv [hidden, kv_heads*head_dim], wo [q_heads*head_dim,
        hidden], optional bq/bk/bv/bo biases, optional q_norm/k_norm [head_dim], mlp_norm [hidden],
        with norm_kind "layernorm": attn_norm_bias, mlp_norm_bias [hidden] float32,
        or, after `fuse_qkv` (the engine's layout on CPU), wqkv [hidden, (q_heads + 2 kv_heads)*head_dim] and
        optional bqkv in place of wq/wk/wv and bq/bk/bv,
        with attention_sinks: sinks [q_heads] float32 (a sink logit per head joins its softmax),
        with sandwich_norms: post_attn_norm, post_mlp_norm [hidden],
        dense MLP layers: w_gate_up [hidden, 2, intermediate], w_down [intermediate, hidden],
        or without gated_mlp: w_up [hidden, intermediate], b_up [intermediate], w_down, b_down [hidden],
        mixture-of-experts layers (cfg.is_moe_layer(i); computed by `models.moe.moe_mlp`) instead:
            router [hidden, experts], optional router_bias [experts] float32,
            experts_gate_up [experts, hidden, 2, moe_intermediate], experts_down [experts, moe_intermediate, hidden],
            optional experts_gate_up_bias [experts, 2, moe_intermediate], experts_down_bias [experts, hidden].
The projections (wq, wk, wv, wo, w_gate_up, w_down), the expert weights, the lm_head and the embedding may be a
`netra_jax.quant` quantized weight instead of an array (int8 or fp8 with per-channel scales, or GGML blocks): the
projections and the lm_head go through `quant.matmul`, the experts through `models.moe.expert_matmul`, the
embedding through `quant.embedding_rows`; the router is an array.
Gemma's (1 + w) norm weights are folded to plain multipliers at load time, so every RMSNorm here is x * rsqrt * w
(`norm`: RMSNorm, or LayerNorm (x - mean) * rsqrt(var + eps) * w + b with norm_kind "layernorm").

Differentiation: `forward`, `hidden_states` and `forward_dense` are differentiable in the parameters and in
`input_embeds`, in reverse mode (`jax.grad`, `jax.vjp`) and forward mode (`jax.jvp`, `jax.linearize`, `jax.jacfwd`),
to any order (Hessian-vector products by `jax.jvp` of `jax.grad`), on every attention backend: attention's
derivatives are a dense jnp reference's (`netra_jax.ops.attention.paged_attention_dense`, memory T x block-table
keys per layer), the experts' grouped matmul's a masked product of every row with every expert
(`models.moe.grouped_matmul`; quantized experts: in the activations, not the weights).
With matmul_backend "cpu_rows" (the CPU engine's), a step of at most 32 tokens runs its dense float32 layers as one
C++ call each (`netra_jax.ops.cpu_decode_layer`, this module's `_layer` its reference), which is not differentiable:
take "xla" for gradients. matmul_backend "cpu_invariant" (with attention backend "cpu_invariant": the batch-invariant
engine and `netra_jax.rl.sequence_logprobs`) keeps activations in float32, multiplies every row on the in-order CPU
kernel and sums norms and expert outputs in a fixed order: a row's result never depends on the other rows, and it is
differentiable.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.config import ModelConfig
from netra_jax.models.head_parallel import auto_axes_layer, forward_mesh, head_parallel
from netra_jax.models.hooks import (
    MODEL_LAYER,
    Hooks,
    HookSpec,
    LayerGroups,
    StepHooks,
    apply_point,
    hook_context,
    layer_inputs,
    pattern_point,
    step_hooks,
)
from netra_jax.models.lora import LayerLoRA, from_device_major, lora_delta
from netra_jax.models.moe import moe_mlp
from netra_jax.models.norms import activation, norm, rms_norm
from netra_jax.models.rope import rope, rope_tables
from netra_jax.models.weight_map import TP
from netra_jax.ops import cpu_decode_layer
from netra_jax.ops.attention import (
    AttentionMetadata,
    attention,
    with_token_layout,
    write_kv,
)
from netra_jax.ops.attention.paged_batch import build_batch
from netra_jax.ops.kv_quant import Pages, empty_pages
from netra_jax.quant import ROW_INVARIANT, GGMLWeight, embedding_rows, matmul


@flax.struct.dataclass
class KVCache:
    """Paged KV cache: one K and one V cache per layer, [num_pages, page_size, kv_heads, head_dim], each a float array
    or, for an int8 / fp8 cache, a `QuantizedPages` (values and one float32 scale per slot and KV head)."""

    k: list[Pages]
    v: list[Pages]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, sharding=None) -> KVCache:
    """A zeroed cache of num_pages pages in `dtype`: float32 / bfloat16 arrays, or int8 / float8_e4m3fn / float8_e5m2
    `QuantizedPages` (see `netra_jax.ops.kv_quant`). sharding: the pages' (the default: the first device)."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    # committed to a device like the step's donated outputs, so the first step compiles the variant later steps use
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def zeros():
        return empty_pages(shape, dtype, sharding)

    return KVCache(k=[zeros() for _ in range(cfg.num_layers)], v=[zeros() for _ in range(cfg.num_layers)])


def _linear(x: jax.Array, w, b: jax.Array | None = None, mb: str = "xla") -> jax.Array:
    y = matmul(x, w, backend=mb)  # float or int8-quantized weight; mb: the matmul backend
    return y if b is None else y + b.astype(y.dtype)


def _with_lora(
    y: jax.Array, x: jax.Array, lora: tuple[LayerLoRA, jax.Array] | None, group: str, mb: str = "xla"
) -> jax.Array:
    """y (the group's outputs side by side, as its fused weight gives them) plus the adapters' delta of that group of
    projections on input x (see `netra_jax.models.lora`; mb: the matmul backend, which picks its kernel); y itself
    without adapters."""
    if lora is None:
        return y
    layer, slots = lora
    return y + lora_delta(x, layer[group], slots, mb)


def _tp(mesh) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def _no_point(name: str, x: jax.Array) -> jax.Array:
    return x  # a layer without hooks


def _ungated_mlp(x: jax.Array, lp: dict, cfg: ModelConfig, mb: str, lora=None, mesh=None, point=_no_point):
    """The MLP without a gate (cfg.gated_mlp False: GPT-2, GPT-NeoX): act(x @ w_up + b_up) @ w_down + b_down,
    x [T, hidden] -> [T, hidden]; hook points mlp_pre (the pre-activation [T, intermediate]) and mlp_post (the
    neurons). An adapter slot's up delta (the second half of its gate_up group) adds to the pre-activation."""
    pre = _linear(x, lp["w_up"], lp.get("b_up"), mb)  # [T, intermediate]
    if lora is not None:
        inter = pre.shape[1]
        d = from_device_major(lora_delta(x, lora[0]["gate_up"], lora[1], mb), [inter, inter], _tp(mesh))
        pre = pre + d[:, inter:]
    h = point("mlp_post", activation(point("mlp_pre", pre), cfg.hidden_act))
    return _with_lora(_linear(h, lp["w_down"], lp.get("b_down"), mb), h, lora, "down", mb)


def _mlp(x: jax.Array, lp: dict, cfg: ModelConfig, mb: str, lora=None, mesh=None, point=_no_point) -> jax.Array:
    """The dense MLP: x [T, hidden] -> [T, hidden]; `point(name, value)` runs the hook points mlp_pre (the gate's
    pre-activation [T, intermediate]) and mlp_post (the neurons act(gate) * up [T, intermediate])."""
    if not cfg.gated_mlp:
        return _ungated_mlp(x, lp, cfg, mb, lora, mesh, point)
    gu = matmul(x, lp["w_gate_up"], "th,hki->tki", backend=mb)  # [T, 2, intermediate]
    if lora is not None:  # the gate and up deltas in one pair of matmuls (B device-major under tensor parallelism)
        T, _, inter = gu.shape
        d = from_device_major(lora_delta(x, lora[0]["gate_up"], lora[1], mb), [inter, inter], _tp(mesh))
        gu = (gu.reshape(T, 2 * inter) + d).reshape(T, 2, inter)
    gate, up = point("mlp_pre", gu[:, 0]), gu[:, 1]
    act = activation(gate, cfg.hidden_act)
    h = point("mlp_post", act * up)
    return _with_lora(_linear(h, lp["w_down"], mb=mb), h, lora, "down", mb)


def _masking(cfg: ModelConfig, i: int) -> dict:
    """Layer i's softmax scale, sliding window and logit soft-cap, as the attention ops take them."""
    return {"scale": cfg.attn_scale, "sliding_window": cfg.layer_window(i), "soft_cap": cfg.attn_logit_softcap}


def _write_and_attend(q, k, v, kp, vp, md, sinks, *, cfg: ModelConfig, i: int, backend: str):
    kp, vp = write_kv(kp, vp, k, v, md.slot_mapping)
    o = attention(q, kp, vp, md, **_masking(cfg, i), sinks=sinks, backend=backend)  # [T, q_heads, head_dim]
    return o, kp, vp


def _attention_heads(
    x, lp, cfg: ModelConfig, i: int, positions, kp, vp, md, backend: str, mesh, mb: str, lora=None, point=_no_point
):
    """Attention of layer i before its output projection: x [T, hidden] -> (each head's output [T, q_heads,
    head_dim], K pages, V pages, the queries attention read [T, q_heads, head_dim]). `point(name, value)` runs the
    hook points q, k, v (the projections' outputs) and q_rot, k_rot (after q/k-norm and RoPE)."""
    T = x.shape[0]
    if "wqkv" in lp:  # the three projections as one matmul (fuse_qkv)
        qkv = _linear(x, lp["wqkv"], lp.get("bqkv"), mb)  # [T, q_size + 2 kv_size]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=1)
    else:
        q, k, v = (_linear(x, lp[w], lp.get(b), mb) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    if lora is not None:  # the q, k and v deltas in one pair of matmuls
        d = lora_delta(x, lora[0]["qkv"], lora[1], mb)  # [T, q_size + 2 kv_size] (device-major under TP)
        d = from_device_major(d, [cfg.q_size, cfg.kv_size, cfg.kv_size], _tp(mesh))
        dq, dk, dv = jnp.split(d, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=1)
        q, k, v = q + dq, k + dk, v + dv
    q = point("q", q.reshape(T, cfg.num_heads, cfg.head_dim))
    k = point("k", k.reshape(T, cfg.num_kv_heads, cfg.head_dim))
    v = point("v", v.reshape(T, cfg.num_kv_heads, cfg.head_dim))
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, mb in ROW_INVARIANT)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, mb in ROW_INVARIANT)
    if cfg.position_embedding == "rope":
        rc = cfg.layer_rope(i)
        q, k = rope(q, positions, rc, cfg.rotary_dim), rope(k, positions, rc, cfg.rotary_dim)
    q, k = point("q_rot", q), point("k_rot", k)
    fn = functools.partial(_write_and_attend, cfg=cfg, i=i, backend=backend)
    if mesh is not None:  # tensor parallel: each device attends with its own heads and KV pages
        fn = head_parallel(fn, mesh)
    return (*fn(q, k, v, kp, vp, md, lp.get("sinks")), q)


@functools.partial(jax.jit, static_argnames=("cfg", "i", "backend", "mesh", "hooks", "pattern_keys", "matmul_backend"))
def _layer(
    x,
    lp,
    kp,
    vp,
    positions,
    md,
    hook_ctx=None,
    hook_in=None,
    lora=None,
    *,
    cfg: ModelConfig,
    i: int,
    backend: str,
    mesh,
    hooks: LayerGroups | None = None,
    pattern_keys: int | None = None,
    matmul_backend: str = "xla",
):
    """One decoder layer, shaped as layer i: x [T, hidden] -> (x, its K and V pages, recorded activations). A
    nested jit, so a model's alike layers are traced and lowered once per step variant instead of once each
    (start-up time); XLA inlines the calls, and the compiled step is the one the unrolled loop gives. `hooks`: this
    layer's hook points of every hook set of the step (see `netra_jax.models.hooks`), run with `hook_ctx` and their
    traced inputs `hook_in`; pattern_keys: the keys a hooked attention pattern spans (None: the block table's).
    lora: (this layer's adapter slots, each token's slot [T]) or None (see `netra_jax.models.lora`)."""
    records: dict[str, jax.Array] = {}

    def point(name, value):
        return apply_point(value, name, hooks, hook_ctx, hook_in, records)

    T = x.shape[0]
    x = point("resid_pre", x)
    x_in = x  # the MLP's input too with cfg.parallel_residual
    h = norm(x, lp, "attn_norm", cfg, matmul_backend)
    mb = matmul_backend
    o, kp, vp, q = _attention_heads(h, lp, cfg, i, positions, kp, vp, md, backend, mesh, mb, lora, point)
    if hooks is not None and hooks.touches("pattern"):  # o: [T, q_heads, head_dim]
        o = pattern_point(o, q, kp, vp, md, lp.get("sinks"), _masking(cfg, i), hooks, hook_ctx, pattern_keys, point)
    o = point("attn_heads", o).reshape(T, cfg.q_size)
    h = _with_lora(_linear(o, lp["wo"], lp.get("bo"), mb), o, lora, "o", mb)
    if cfg.sandwich_norms:
        h = norm(h, lp, "post_attn_norm", cfg, matmul_backend)
    x = point("resid_mid", x + point("attn_out", h))
    h = norm(x_in if cfg.parallel_residual else x, lp, "mlp_norm", cfg, matmul_backend)
    h = moe_mlp(h, lp, cfg, mesh, mb) if cfg.is_moe_layer(i) else _mlp(h, lp, cfg, mb, lora, mesh, point)
    if cfg.sandwich_norms:
        h = norm(h, lp, "post_mlp_norm", cfg, matmul_backend)
    x = point("resid_post", x + point("mlp_out", h))
    return x, kp, vp, records


def fuse_qkv(params: dict) -> dict:
    """The parameters with each layer's q, k and v projections joined along their outputs into one weight
    "wqkv" [hidden, q_size + 2 kv_size] (and their biases into "bqkv"): one matmul a layer instead of three, the
    same products (the forward splits its output). A decode step on CPU is a stream of small matmuls, each paying
    XLA's dispatch and thread wake-ups: this takes 60 of SmolLM2's 180 away. Plain arrays of one dtype are joined,
    and GGUF blocks of one type (their rows, one per output feature, stacked: a 1 B Q4_0 decode step 3% faster);
    layers whose three weights are neither (other quantized forms, a Q4_K_M layer's Q6_K v), or that have some of
    the three biases and not the others, are left as they are. Until the caller drops the old tree, the joined
    weights are held beside the originals (the q, k and v share of the model: 12% of SmolLM2's bytes)."""
    layers = []
    for lp in params["layers"]:
        ws = [lp.get(k) for k in ("wq", "wk", "wv")]
        bs = [lp.get(k) for k in ("bq", "bk", "bv")]
        joined = _joined(ws)
        if joined is None or (any(b is not None for b in bs) and any(b is None for b in bs)):
            layers.append(lp)
            continue
        fused = {k: v for k, v in lp.items() if k not in ("wq", "wk", "wv", "bq", "bk", "bv")}
        fused["wqkv"] = joined
        if bs[0] is not None:
            fused["bqkv"] = jnp.concatenate(bs)
        layers.append(fused)
    return {**params, "layers": layers}


def _joined(ws: list) -> jax.Array | GGMLWeight | None:
    """q, k and v [hidden, n_i] as one weight [hidden, sum n_i], or None when they cannot be joined."""
    if all(isinstance(w, jax.Array | np.ndarray) and w.ndim == 2 and w.dtype == ws[0].dtype for w in ws):
        return jnp.concatenate(ws, axis=1)
    first = ws[0]
    if all(
        isinstance(w, GGMLWeight)
        and w.transposed
        and w.batch_dims == 0
        and w.data.ndim == 2
        and (w.qtype, w.dtype, w.data.shape[1]) == (first.qtype, first.dtype, first.data.shape[1])
        for w in ws
    ):
        data = jnp.concatenate([w.data for w in ws])  # [sum n_i, row_bytes]: the three matrices' rows in turn
        return GGMLWeight(data, first.qtype, transposed=True, dtype=first.dtype)
    return None


def embed_tokens(params: dict, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """The embedding layer's output for token ids, as Hugging Face's `get_input_embeddings()(ids)` gives it: the
    table's rows, times sqrt(hidden) for Gemma 3 (`cfg.scale_embeddings`). What `forward(..., input_embeds=...)`
    takes in place of ids. token_ids: [T] int; returns [T, hidden] in the table's dtype."""
    x = embedding_rows(params["embed"], token_ids)  # [T, hidden]; a GGML table de-quantizes only these rows
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    return x


def _inputs(params: dict, cfg: ModelConfig, token_ids: jax.Array | None, input_embeds: jax.Array | None) -> jax.Array:
    """The first layer's input [T, hidden]: ids embedded, or the given embeddings (exactly one of the two)."""
    if (token_ids is None) == (input_embeds is None):
        raise ValueError("pass exactly one of token_ids and input_embeds")
    if token_ids is not None:
        return embed_tokens(params, cfg, token_ids)
    if input_embeds.ndim != 2 or input_embeds.shape[1] != cfg.hidden_size:
        raise ValueError(f"input_embeds must be [tokens, hidden={cfg.hidden_size}], got {input_embeds.shape}")
    return input_embeds


def hidden_states(
    params: dict,
    cfg: ModelConfig,
    token_ids: jax.Array | None,
    positions: jax.Array,
    kv: KVCache,
    md: AttentionMetadata,
    rows: jax.Array | None = None,
    *,
    backend: str = "reference",
    mesh: jax.sharding.Mesh | None = None,
    input_embeds: jax.Array | None = None,
    hooks: Hooks | HookSpec | StepHooks | None = None,
    hook_arrays: dict | None = None,
    hook_request: jax.Array | None = None,
    hook_group: jax.Array | None = None,
    matmul_backend: str = "xla",
    lora: list[LayerLoRA] | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, dict[str, jax.Array]]:
    """The decoder stack up to the final norm (no lm_head): what `forward` turns into logits and embedding models
    pool. Arguments as `forward`'s; rows: [S] int32 rows wanted (all rows if None).
    Returns (final-normed hidden states [S or T, hidden] in the parameters' dtype, updated kv cache), and with
    `hooks` the recorded activations as a third element."""
    mesh = forward_mesh(mesh)  # None: an Explicit-axis mesh set by jax.set_mesh
    x = _inputs(params, cfg, token_ids, input_embeds)  # [T, hidden]
    if matmul_backend in ROW_INVARIANT:  # activations in float32 (weights and KV pages as stored): no bfloat16
        x = x.astype(jnp.float32)  # intermediate whose rounding XLA may keep or elide depending on the program
    if cfg.position_embedding == "learned":  # each position's row of the table (positions past it: the last row)
        x = x + jnp.take(params["pos_embed"], positions, axis=0, mode="clip").astype(x.dtype)
    md = with_token_layout(md, x.shape[0])  # once per step, not per layer (unused by kernels: removed by XLA)
    ctx = None
    if hooks is not None:
        if isinstance(hooks, Hooks):
            hooks.check(cfg)
        hooks, hook_arrays = step_hooks(hooks, hook_arrays)
        ctx = hook_context(md, positions, hook_request, hook_group)
    new_k, new_v = [], []
    records: dict[str, jax.Array] = {}
    first_of_kind: dict = {}  # layers alike (window, rope, MoE) share one traced layer: the first of their kind
    if (lora is None) != (lora_slots is None):
        raise ValueError("lora and lora_slots go together: the adapter slots and each token's slot [T]")
    one_call = matmul_backend in ("cpu_rows", "cpu_rows_q8") and backend == "cpu" and mesh is None
    tables: dict = {}  # RoPE tables per rope setting, for the layers run as one kernel call
    for i, lp in enumerate(params["layers"]):
        layer_lora = None if lora is None else (lora[i], lora_slots)
        lh = None if hooks is None else hooks.at(i)  # a layer without hooks may still run as one kernel call
        layer_lora_slots = None if lora is None else lora[i]
        if one_call and lh is None and cpu_decode_layer.takes(lp, cfg, i, kv.k[i], x.shape[0], layer_lora_slots):
            rc = cfg.layer_rope(i)
            if rc not in tables:
                tables[rc] = rope_tables(positions, rc, cfg.rotary_dim)
            lay = md.layout
            x, kp, vp = cpu_decode_layer.decode_layer(
                x,
                lp,
                kv.k[i],
                kv.v[i],
                *tables[rc],
                md.slot_mapping,
                lay.q_pos,
                lay.valid,
                lay.rows,
                layer_lora,
                cfg=cfg,
                i=i,
            )
            new_k.append(kp)
            new_v.append(vp)
            continue
        like = first_of_kind.setdefault((cfg.layer_window(i), cfg.layer_rope(i), cfg.is_moe_layer(i)), i)
        layer = auto_axes_layer(_layer, mesh, kv.k[i], kv.v[i])  # on an Explicit-axis mesh: as on an Auto one
        x, kp, vp, rec = layer(
            x,
            lp,
            kv.k[i],
            kv.v[i],
            positions,
            md,
            None if lh is None else ctx,
            layer_inputs(hook_arrays, lh),
            layer_lora,
            cfg=cfg,
            i=like,
            backend=backend,
            mesh=mesh,
            hooks=lh,
            pattern_keys=None if hooks is None else hooks.pattern_keys,
            matmul_backend=matmul_backend,
        )
        new_k.append(kp)
        new_v.append(vp)
        records.update(rec)
    top = None if hooks is None else hooks.at(MODEL_LAYER)  # the model-level points, final_norm and logits
    if top is not None and top.touches("final_norm"):  # every row through the hook, then the rows wanted
        x = norm(x, params, "final_norm", cfg, matmul_backend)
        x = apply_point(x, "final_norm", top, ctx, layer_inputs(hook_arrays, top), records)
        normed = x if rows is None else x[rows]
    else:
        normed = norm(x if rows is None else x[rows], params, "final_norm", cfg, matmul_backend)
    out = normed, KVCache(k=new_k, v=new_v)
    return out if hooks is None else (*out, records)


def unembed(params: dict, cfg: ModelConfig, x: jax.Array, *, matmul_backend: str = "xla") -> jax.Array:
    """Logits of hidden states: the final norm's output x [N, hidden] -> [N, vocab] float32 (lm_head, then the final
    soft-cap). With `final_norm` applied first, the logit lens of any residual stream: unembed(params, cfg,
    norm(resid, params, "final_norm", cfg))."""
    logits = matmul(x, params["lm_head"], preferred_element_type=jnp.float32, backend=matmul_backend)  # [N, vocab]
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def logit_lens(params: dict, cfg: ModelConfig, resid: jax.Array) -> jax.Array:
    """What the model would predict from residual stream `resid` [N, hidden] (e.g. a recorded
    "layers.{i}.resid_post"): final norm, lm_head and soft-cap, as after the last layer. Returns [N, vocab] float32."""
    return unembed(params, cfg, norm(resid, params, "final_norm", cfg))


def forward(
    params: dict,
    cfg: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv: KVCache,
    md: AttentionMetadata,
    logits_indices: jax.Array | None = None,
    *,
    backend: str = "reference",
    mesh: jax.sharding.Mesh | None = None,
    input_embeds: jax.Array | None = None,
    hooks: Hooks | HookSpec | StepHooks | None = None,
    hook_arrays: dict | None = None,
    hook_request: jax.Array | None = None,
    hook_group: jax.Array | None = None,
    matmul_backend: str = "xla",
    lora: list[LayerLoRA] | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, dict[str, jax.Array]]:
    """Run the model on a flat batch of new tokens, writing their K/V into the pages.

    token_ids, positions: [T] int32 (token_ids None when input_embeds is given). logits_indices: [S] int32 rows whose
    logits are wanted (all rows if None). mesh: a tensor-parallel ("tp",) mesh when params and pages are sharded as
    `netra_jax.parallel` lays them out, its axis Auto or Explicit (None: an Explicit one set by `jax.set_mesh`, see
    `models.head_parallel.forward_mesh`). input_embeds: [T, hidden] the embedding layer's output in place of token ids,
    as Hugging Face's `inputs_embeds` (Gemma's sqrt(hidden) scale already applied, see `embed_tokens`; GPT-2's
    learned position rows are added here, as transformers adds them to `inputs_embeds`).
    hooks: a `Hooks` set, or its static spec (`Hooks.spec`) with its traced inputs in hook_arrays (`Hooks.arrays`),
    or a step's `StepHooks` (several sets) with a tuple of arrays, one per set; hook_request [T] int32 each token's
    request index for `HookContext.request` (default 0), hook_group [T] int32 each token's hook set (default 0; -1:
    none), both -1 for padding: see `netra_jax.models.hooks`. Recorded activations are [T, ...] over all rows
    (padding included); with a `logits` hook every row's logits are computed, then logits_indices' rows returned.
    matmul_backend: "xla" (jnp's dot), or "cpu_rows" to run float32 matmuls of decode-sized batches on the CPU kernel
    of `netra_jax.ops.cpu_matmul` and, with the "cpu" attention backend, the dense float32 layers without hooks of
    a step of at most 32 tokens as one call each of `netra_jax.ops.cpu_decode_layer` (what the engine runs on CPU;
    unsharded parameters only, lowers for CPU only, not differentiable); "cpu_invariant" for batch-invariant rows
    (see the module docstring).
    lora, lora_slots: LoRA adapter slots (per layer {group: (a [in, S, Rg], b [S, Rg, out])}, `lora.empty_slots`)
    and each token's slot [T] int32 (-1: the base model), see `netra_jax.models.lora`; differentiable in the factors.
    Returns (logits [S or T, vocab] float32, updated kv cache), and with hooks a third element, the recorded
    activations {hook name: array}.
    """
    if hooks is not None:
        if isinstance(hooks, Hooks):
            hooks.check(cfg)
        hooks, hook_arrays = step_hooks(hooks, hook_arrays)
    top = None if hooks is None else hooks.at(MODEL_LAYER)
    hook_logits = top is not None and top.touches("logits")  # every row's logits through the hook
    out = hidden_states(
        params,
        cfg,
        token_ids,
        positions,
        kv,
        md,
        None if hook_logits else logits_indices,
        backend=backend,
        mesh=mesh,
        input_embeds=input_embeds,
        hooks=hooks,
        hook_arrays=hook_arrays,
        hook_request=hook_request,
        hook_group=hook_group,
        matmul_backend=matmul_backend,
        lora=lora,
        lora_slots=lora_slots,
    )
    logits = unembed(params, cfg, out[0], matmul_backend=matmul_backend)  # [S or T, vocab]
    if hook_logits:
        md = with_token_layout(md, logits.shape[0])
        ctx = hook_context(md, positions, hook_request, hook_group)
        logits = apply_point(logits, "logits", top, ctx, layer_inputs(hook_arrays, top), out[2])
        logits = logits if logits_indices is None else logits[logits_indices]
    return (logits, *out[1:])


_SCRATCH_PAGE = 16  # page size of `forward_dense`'s scratch cache (every backend takes it)


def _scratch_sequence(cfg: ModelConfig, num_tokens: int, dtype) -> tuple[KVCache, AttentionMetadata]:
    """A zeroed paged cache for one sequence of num_tokens new tokens (positions 0.., on pages 0, 1, ...) and its
    metadata (`build_batch`, constants under a trace), with the reference's work lists."""
    pages = -(-num_tokens // _SCRATCH_PAGE)
    batch = build_batch([num_tokens], [num_tokens], [range(pages)], page_size=_SCRATCH_PAGE, num_pages=pages)
    return init_kv_cache(cfg, pages, _SCRATCH_PAGE, dtype), batch.metadata


def forward_dense(
    params: dict,
    cfg: ModelConfig,
    x: jax.Array,
    *,
    backend: str = "reference",
    matmul_backend: str = "xla",
    lora: list[LayerLoRA] | None = None,
    lora_slot: int | jax.Array | None = None,
    hooks: Hooks | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Logits at every position of one sequence, without a cache argument: `forward` on a scratch paged cache
    that holds just this sequence (positions 0..T-1). For training-style use.

    Jittable (with cfg and backend static), differentiable (reverse and forward mode, any order) in params and in x
    when x holds embeddings (attention's derivatives are dense, see `netra_jax.ops.attention`), and vmap-able over a
    leading batch axis of x, derivatives included (sequences of one length; the cache and metadata are shared
    constants, so the loops' trip counts stay unbatched; a MoE layer runs the batch's tokens as one set of grouped
    matmuls, see `models.moe.grouped_matmul`).

    Args:
        params: the parameter pytree (see the module docstring).
        cfg: the model's config.
        x: token ids [T] (integer) or embeddings [T, hidden] (float, the embedding layer's output as
            `embed_tokens` gives it, like Hugging Face's `inputs_embeds`).
        backend: the attention backend (see `netra_jax.ops.attention.BACKENDS`).
        matmul_backend: the matmul backend (see `netra_jax.quant.matmul.BACKENDS`; its kernels are not
            differentiable: keep "xla" for gradients).
        lora: LoRA adapter slots (`netra_jax.models.lora.empty_slots` / `set_slot`); differentiable in their
            factors.
        lora_slot: The slot the whole sequence uses with `lora` (-1 or None: the base model).
        hooks: A `Hooks` set (see `netra_jax.models.hooks`) run in the forward, the same points and names as the
            engine's; differentiable through the edits and in `hooks.data` (pass data as an argument of the
            function you differentiate).

    Returns:
        logits [T, vocab] float32; with hooks, (logits, the recorded activations {name: [T, ...]}).
    """
    ids = jnp.issubdtype(x.dtype, jnp.integer)
    if (x.ndim, ids) not in ((1, True), (2, False)) or x.shape[0] == 0:
        raise ValueError(
            f"x must be token ids [T] (integer) or embeddings [T, hidden] (float), T > 0; got {x.dtype} {x.shape}"
        )
    T = x.shape[0]
    if hooks is not None:
        hooks.check(cfg)
    kv, md = _scratch_sequence(cfg, T, params["embed"].dtype)
    positions = jnp.arange(T, dtype=jnp.int32)
    token_ids, embeds = (x, None) if ids else (None, x)
    slots = None
    if lora is not None:
        slots = jnp.full((T,), -1 if lora_slot is None else lora_slot, jnp.int32)
    out = forward(
        params,
        cfg,
        token_ids,
        positions,
        kv,
        md,
        backend=backend,
        input_embeds=embeds,
        matmul_backend=matmul_backend,
        lora=lora,
        lora_slots=slots,
        hooks=None if hooks is None else StepHooks((hooks.spec,), pattern_keys=T),  # patterns over the T keys
        hook_arrays=None if hooks is None else (hooks.arrays,),
    )
    return out[0] if hooks is None else (out[0], out[2])
