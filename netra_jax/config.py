"""The model's configuration: its shape and variant flags (from a Hugging Face config.json or GGUF metadata) and RoPE
settings, as frozen dataclasses, hashable so a config is a jit static arg. The engine's options: engine_config."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our model family (which weight map reads it)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    # base models without a language-model head, as embedding checkpoints name them (served with task "embed")
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")  # gelu: exact (erf); gelu_tanh: its tanh approximation
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_EMBEDDINGS = ("rope", "learned")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# HF activation names -> ours (gelu_new, GPT-2's, is the tanh approximation)
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
# config.json keys -> the names some families give them (GPT-2's, GPT-NeoX's older ones), read when the key is absent
_KEY_ALIASES = {
    "hidden_size": ("n_embd",),
    "num_hidden_layers": ("n_layer",),
    "num_attention_heads": ("n_head",),
    "max_position_embeddings": ("n_positions",),
    "intermediate_size": ("n_inner",),
    "hidden_act": ("activation_function",),
    "rms_norm_eps": ("layer_norm_eps", "layer_norm_epsilon"),
    "rope_theta": ("rotary_emb_base",),
    "partial_rotary_factor": ("rotary_pct",),
}
_GEMMA = ("gemma2", "gemma3")  # (1 + w) norms, sandwich norms, sqrt(hidden) embedding scale, query_pre_attn_scalar
_GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}  # every period-th layer full attention, the others sliding
_LAYERNORM = ("gpt2", "gpt_neox")  # LayerNorm with bias, an up -> activation -> down MLP with biases


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be served (unsupported architecture, rope type, missing field)."""


def json_object(value: dict[str, Any] | str, what: str) -> dict[str, Any]:
    """A settings object given as a dict or as its JSON text (a CLI flag); ConfigError naming `what` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE setting as a config gives it (`from_dict`): its type and parameters. `netra_jax.models.rope` computes
    from it what transformers' `modeling_rope_utils` does: the rotated dims' inverse frequencies and the factor that
    scales cos and sin (YaRN's attention factor, 1 for the other types)."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the pre-training context
    beta_fast: float = 32.0  # yarn: rotations per original context above which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by `factor`
    truncate: bool = True  # yarn: round the ramp's ends to whole dims
    attention_factor: float | None = None  # yarn: explicit cos/sin scale; None = derived from factor and mscale
    mscale: float | None = None  # yarn (DeepSeek style): with mscale_all_dim, the scale's numerator weight
    mscale_all_dim: float | None = None  # yarn: the scale's denominator weight

    @staticmethod
    def from_dict(
        d: dict[str, Any] | None,
        theta: float | None = None,
        *,
        max_position_embeddings: int | None = None,
        original_max_position_embeddings: int | None = None,
    ) -> RopeConfig:
        """A `rope_parameters` (or legacy `rope_scaling`) dict. theta: the config's top-level `rope_theta` when the
        dict has none; max_position_embeddings: the config's, the original context when the dict has none (and,
        for yarn without a factor, the factor's numerator); original_max_position_embeddings: a top-level field of
        that name, which takes precedence over the dict's (Phi-3 layout), as in transformers."""
        d = dict(d or {})
        rope_type = d.get("rope_type", d.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        th = d.get("rope_theta", theta if theta is not None else 10000.0)
        orig = original_max_position_embeddings or d.get("original_max_position_embeddings") or max_position_embeddings
        orig = int(orig or RopeConfig.original_max_position_embeddings)
        factor = d.get("factor")
        if factor is None and rope_type == "yarn":  # transformers: the context extension ratio
            if not max_position_embeddings:
                raise ConfigError("yarn rope scaling without a factor needs max_position_embeddings")
            factor = max_position_embeddings / orig
        return RopeConfig(
            theta=float(th),
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig,
            beta_fast=float(d.get("beta_fast") or 32.0),  # 0 / null mean the default, as in transformers
            beta_slow=float(d.get("beta_slow") or 1.0),
            truncate=bool(d.get("truncate", True)),
            attention_factor=_optional_float(d.get("attention_factor")),
            mscale=_optional_float(d.get("mscale")),
            mscale_all_dim=_optional_float(d.get("mscale_all_dim")),
        )


def _optional_float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of one decoder-only transformer. `family` names the checkpoint's layout (which weight map
    reads it); the forward never branches on it, only on the behaviour flags below."""

    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    family: str  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | qwen3_moe | mixtral | gpt_oss | gpt2 | gpt_neox
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6  # every norm's epsilon (LayerNorm's too)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # one of ACTIVATIONS: the MLP's (its gate's when gated_mlp)
    norm_kind: str = "rmsnorm"  # rmsnorm: x * rsqrt(mean(x^2) + eps) * w | layernorm: centred, * w + bias
    position_embedding: str = "rope"  # rope: rotate q and k | learned: a table of rows added to the embeddings (GPT-2)
    parallel_residual: bool = False  # GPT-NeoX: x + attn(norm1(x)) + mlp(norm2(x)), both blocks reading the layer input
    gated_mlp: bool = True  # act(x @ gate) * (x @ up) -> down | False: act(x @ up + b_up) @ down + b_down (GPT-2, NeoX)
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None = None
    rope_full: RopeConfig = field(default_factory=RopeConfig)
    rope_sliding: RopeConfig = field(default_factory=RopeConfig)
    attn_scale: float = 1.0  # softmax scale applied to q.k
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    qk_norm: bool = False  # Qwen3 / Gemma 3: RMSNorm over head_dim of q and k before rope
    norm_weight_offset: bool = False  # Gemma: checkpoints store norm weights as w - 1 (folded to w at load time)
    sandwich_norms: bool = False  # Gemma 3: post-attention and post-MLP norms besides the pre-norms
    scale_embeddings: bool = False  # Gemma: embeddings multiplied by sqrt(hidden)
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head joins each softmax
    rotary_dim: int = 0  # leading dims of each head RoPE rotates (head_dim * partial_rotary_factor); 0 = head_dim
    # mixture of experts (num_experts == 0: every MLP is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: True = routed experts, False = the dense MLP
    norm_topk_prob: bool = True  # renormalise the top-k routing probabilities to sum to 1
    expert_act: str = "silu"  # silu: silu(gate) * up | swiglu_oai: gpt-oss's clamped (up + 1) * gate * sigmoid
    swiglu_alpha: float = 1.702  # swiglu_oai: sigmoid slope
    swiglu_limit: float = 7.0  # swiglu_oai: clamp of gate (above) and up (both sides)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.rotary_dim:  # frozen: set once, before anyone reads it
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.expert_act not in EXPERT_ACTIVATIONS:
            raise ConfigError(
                f"unknown expert activation {self.expert_act!r}; supported: {', '.join(EXPERT_ACTIVATIONS)}"
            )
        for name, value, allowed in (
            ("activation", self.hidden_act, ACTIVATIONS),
            ("norm kind", self.norm_kind, NORM_KINDS),
            ("position embedding", self.position_embedding, POSITION_EMBEDDINGS),
        ):
            if value not in allowed:
                raise ConfigError(f"unknown {name} {value!r}; supported: {', '.join(allowed)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i (keys with q_pos - k_pos < window are visible), None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def max_context(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, or YaRN's original context times its
        factor when that is longer (Qwen3's long-context recipe adds YaRN and keeps max_position_embeddings)."""
        rc = self.rope_full
        if rc.rope_type == "yarn":
            return max(self.max_position_embeddings, int(rc.original_max_position_embeddings * rc.factor))
        return self.max_position_embeddings

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    def layer_rope(self, i: int) -> RopeConfig:
        return self.rope_sliding if self.layer_types[i] == "sliding_attention" else self.rope_full

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- constructors
    @staticmethod
    def from_hf_dir(path: str | Path, *, trust_remote_code: bool = False) -> ModelConfig:
        """The config.json of a Hugging Face directory (see `from_hf_dict`)."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        return ModelConfig.from_hf_dict(d, trust_remote_code=trust_remote_code)

    @staticmethod
    def from_hf_dict(d: dict[str, Any], *, trust_remote_code: bool = False) -> ModelConfig:
        """A Hugging Face config dict. Remote code is never run: a config with an `auto_map` (code shipped with the
        checkpoint) is refused, unless its architecture is one we implement natively and `trust_remote_code` is
        True, in which case the native implementation is used and the auto_map ignored (as vLLM does for the
        architectures it implements)."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        remote = d.get("auto_map")
        if arch is None:
            what = archs or d.get("model_type")
            if remote:
                raise ConfigError(
                    f"architecture {what!r} is implemented by code shipped with the checkpoint (auto_map), and "
                    "netra_jax never runs remote code, with or without trust_remote_code; natively supported "
                    f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            raise ConfigError(f"unsupported architecture {what!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        if remote and not trust_remote_code:
            raise ConfigError(
                f"the checkpoint asks for remote code (auto_map), which netra_jax never runs; its architecture {arch} "
                "is supported natively: pass trust_remote_code=True (--trust-remote-code) to load it with the "
                "native implementation, ignoring the auto_map"
            )
        d = _with_common_keys(d)
        _check_supported(d)
        try:
            hidden = int(d["hidden_size"])
            n_heads = int(d["num_attention_heads"])
            n_layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
            if family == "gpt2" and d.get("intermediate_size") is None:  # GPT-2's n_inner None: 4 * hidden
                d["intermediate_size"] = 4 * hidden
            inter = int(d["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from e
        head_dim = int(d.get("head_dim") or hidden // n_heads)
        n_kv = int(d.get("num_key_value_heads") or n_heads)
        gemma = family in _GEMMA
        rope_dict = d.get("rope_parameters") or {}
        rope_dict = rope_dict.get("full_attention") or rope_dict  # per layer type: the full-attention layers'
        partial = rope_dict.get("partial_rotary_factor", d.get("partial_rotary_factor"))  # as transformers: dict wins
        if partial is None and family == "gpt_neox":  # GPTNeoXConfig's default rotary_pct
            partial = 0.25
        rotary_dim = int(head_dim * float(partial or 1.0))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ConfigError(f"partial_rotary_factor gives {rotary_dim} rotary dims of {head_dim}; need an even count")

        # layer types / sliding window
        window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if gemma:
            if not layer_types:
                period = _GEMMA_SLIDING_PERIOD[family]
                pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", period)))
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
                ]
        elif family in ("qwen2", "qwen3", "qwen3_moe"):
            if not d.get("use_sliding_window", False):
                window = None
            if not layer_types:
                mwl = int(d.get("max_window_layers", n_layers))
                layer_types = [
                    "sliding_attention" if window and i >= mwl else "full_attention" for i in range(n_layers)
                ]
            if window is None:
                layer_types = ["full_attention"] * n_layers
        else:  # llama / mistral / mixtral / gpt-oss (layer_types given) / gpt2 / gpt_neox: one window for all when set
            if not layer_types:
                layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
        if any(t == "sliding_attention" for t in layer_types) and not window:
            raise ConfigError("sliding_attention layers need a sliding_window")

        # rope: legacy top-level rope_theta/rope_scaling, or rope_parameters (flat or per layer type)
        # (transformers: a top-level original_max_position_embeddings overrides a flat dict's, not a nested one's)
        rp = d.get("rope_parameters")
        lengths = {"max_position_embeddings": d.get("max_position_embeddings")}
        if rp and ("full_attention" in rp or "sliding_attention" in rp):
            rope_full = RopeConfig.from_dict(rp.get("full_attention"), d.get("rope_theta"), **lengths)
            rope_sliding = RopeConfig.from_dict(
                rp.get("sliding_attention", rp.get("full_attention")), d.get("rope_theta"), **lengths
            )
        else:
            orig = d.get("original_max_position_embeddings")
            rope_full = RopeConfig.from_dict(
                rp or d.get("rope_scaling"), d.get("rope_theta"), original_max_position_embeddings=orig, **lengths
            )
            rope_sliding = rope_full
            if family == "gemma3" and not rp:  # Gemma 2's sliding layers rotate as its full ones
                rope_sliding = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))

        if gemma:
            scale = float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5
        elif not d.get("scale_attn_weights", True):  # GPT-2 without the 1/sqrt(head_dim) scale
            scale = 1.0
        else:
            scale = head_dim**-0.5
        hf_act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        act = _HF_ACTIVATIONS.get(hf_act)
        if act is None:
            raise ConfigError(f"unsupported activation {hf_act!r}; supported: {', '.join(_HF_ACTIVATIONS)}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        moe = _moe_fields(d, family, n_layers, inter)
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5 if family in _LAYERNORM else 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma or family == "gpt2")),
            hidden_act=act,
            norm_kind="layernorm" if family in _LAYERNORM else "rmsnorm",
            position_embedding="learned" if family == "gpt2" else "rope",
            parallel_residual=family == "gpt_neox" and bool(d.get("use_parallel_residual", True)),
            gated_mlp=family not in _LAYERNORM,
            layer_types=tuple(layer_types),
            sliding_window=int(window) if window else None,
            rope_full=rope_full,
            rope_sliding=rope_sliding,
            attn_scale=scale,
            attn_logit_softcap=d.get("attn_logit_softcapping"),
            final_logit_softcap=d.get("final_logit_softcapping"),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            norm_weight_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            attention_sinks=family == "gpt_oss",
            rotary_dim=rotary_dim,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )


def _with_common_keys(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of config dict d with each common key (`_KEY_ALIASES`) it lacks, or has as null, read from the first of
    its other names that d has (GPT-2's n_embd for hidden_size, ...)."""
    out = dict(d)
    for key, aliases in _KEY_ALIASES.items():
        alias = next((a for a in aliases if d.get(a) is not None), None)
        if out.get(key) is None and alias is not None:
            out[key] = d[alias]
    return out


def _check_supported(d: dict[str, Any]) -> None:
    """ConfigError for settings of a supported architecture that the forward does not implement."""
    unsupported = {
        "scale_attn_by_inverse_layer_idx": "GPT-2's attention scaled by 1 / (layer + 1)",
        "add_cross_attention": "cross-attention layers",
    }
    for key, what in unsupported.items():
        if d.get(key):
            raise ConfigError(f"{key}: {what} is not supported")


def _moe_fields(d: dict[str, Any], family: str, n_layers: int, intermediate: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields of a HF config (empty for dense families)."""
    if family not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return {}
    n_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    top_k = int(d.get("num_experts_per_tok") or 0)
    if n_experts < 1 or not 0 < top_k <= n_experts:
        raise ConfigError(f"a mixture of experts needs 1 <= num_experts_per_tok ({top_k}) <= experts ({n_experts})")
    if family == "qwen3_moe":  # dense layers: listed in mlp_only_layers, or off the decoder_sparse_step grid
        dense_only = {int(i) for i in d.get("mlp_only_layers") or ()}
        step = int(d.get("decoder_sparse_step") or 1)
        layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n_layers))
        expert_inter = int(d.get("moe_intermediate_size") or intermediate)
    else:
        layers = (True,) * n_layers
        expert_inter = intermediate
    out: dict[str, Any] = dict(
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_inter,
        moe_layers=layers,
        # Qwen3-MoE's config defaults to plain top-k probabilities; Mixtral and gpt-oss always renormalise
        norm_topk_prob=bool(d.get("norm_topk_prob", False)) if family == "qwen3_moe" else True,
    )
    if family == "gpt_oss":
        out.update(
            expert_act="swiglu_oai",
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        )
    return out
