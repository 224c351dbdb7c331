"""ModelConfig from GGUF metadata: the llama.cpp keys are rewritten into an equivalent Hugging Face config dict
and built by `ModelConfig.from_hf_dict`, so one code path validates both formats."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from netra_jax.config import ConfigError, ModelConfig, RopeConfig
from netra_jax.models.rope import attention_scaling, inv_freq

# GGUF general.architecture -> HF architecture name. Mistral checkpoints are converted by llama.cpp as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gptneox": "GPTNeoXForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# Gemma 3 keys llama.cpp's converter does not write, defaulted as llama.cpp's loader does (src/llama-model.cpp,
# llama_model::load_hparams, case LLM_ARCH_GEMMA3): only when `gemma3.attention.sliding_window` is present and > 0
# do layers use the window, in periods of `attention.sliding_window_pattern` (default 6; set_swa_pattern in
# llama-hparams.cpp: layer i slides unless i % period == period - 1, period 0 = every layer slides), the sliding
# layers rotating with `rope.freq_base_swa` (default llama_hparams::rope_freq_base_train_swa = 10000) and no rope
# scaling; without a window no layer slides. Older llama.cpp fixed the same 6 and 10000 without reading the keys.
# The query scale (f_attention_scale) is 1/sqrt(hidden / heads) for the 27B (62 layers) and 1/sqrt(head_dim) for
# the other sizes; llama.cpp reads no key for it, `attention.scale` overrides it here when a file has one.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_SWA_THETA = 10000.0
# Gemma 2 (llama_model::load_hparams, case LLM_ARCH_GEMMA2): set_swa_pattern(2), even layers sliding, every layer
# rotating with rope.freq_base; the query scale 1/sqrt(hidden / heads) for the 27B (46 layers), else 1/sqrt(head_dim).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": _GEMMA3_SWA_PATTERN}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# the MLP activation of each architecture (the file names none): llama.cpp's GPT-NeoX graph runs ggml's tanh GELU,
# the checkpoints it converts were trained with the exact one (transformers' "gelu"), which is what is read here
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh", "gpt2": "gelu_new", "gptneox": "gelu"}


def _llama3_rope_from_factors(factors: np.ndarray, theta: float, rotary_dim: int, meta_orig: int | None) -> dict:
    """Recover llama3 rope-scaling parameters from llama.cpp's `rope_freqs` tensor (per-frequency divisors)."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape[0] != rotary_dim // 2:
        raise ConfigError(f"rope_freqs has {factors.shape[0]} entries, expected rotary dims / 2 = {rotary_dim // 2}")
    if np.allclose(factors, 1.0):
        return {}
    factor = float(factors.max())
    for orig in dict.fromkeys([meta_orig or 8192, 8192]):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            rc = RopeConfig(theta, "llama3", factor, low, high, orig)
            base, scaled = np.array(inv_freq(RopeConfig(theta), rotary_dim)), np.array(inv_freq(rc, rotary_dim))
            if np.allclose(base / scaled, factors, rtol=1e-3):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                }
    raise ConfigError("the file's rope_freqs tensor does not match any llama3 rope scaling this runtime supports")


def _yarn_rope(key: Callable[..., Any], arch: str) -> dict:
    """HF yarn rope parameters from llama.cpp's keys: convert_hf_to_gguf.py writes the factor and the original context
    always, the betas and `attention_factor` (as yarn_attn_factor) when the HF config has them."""
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor"))}
    orig = key("rope.scaling.original_context_length", None)
    if orig is not None:  # else both transformers and llama.cpp take the context length
        rope["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if (v := key(f"rope.scaling.{gguf_key}", None)) is not None:
            rope[hf_key] = float(v)
    if log_mul := key("rope.scaling.yarn_log_multiplier", None):  # llama.cpp: mscale_all_dim, with mscale 1
        rope.update(mscale=1.0, mscale_all_dim=float(log_mul))
    ext = key("rope.scaling.yarn_ext_factor", None)
    if ext is not None and float(ext) != 1.0:
        raise ConfigError(f"YaRN extrapolation factor {ext} is not supported (transformers' YaRN uses 1)")
    attn = key("rope.scaling.attn_factor", None)  # llama.cpp multiplies the YaRN attention scale by it
    if attn is not None and float(attn) != 1.0:
        rope["attention_factor"] = attention_scaling(RopeConfig.from_dict(rope)) * float(attn)
    if arch == "gpt-oss":
        # the file has no key for it: gpt-oss's HF config (and OpenAI's reference code) ramp over unrounded dims,
        # where llama.cpp rounds them; follow the HF checkpoint
        rope["truncate"] = False
    return rope


def _partial_rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """The smallest factor f with int(head_dim * f) == rotary_dim, the rounding transformers (and ModelConfig) use."""
    f = rotary_dim / head_dim
    while int(head_dim * f) < rotary_dim:
        f = math.nextafter(f, 1.0)
    return f


def gguf_to_hf_config(
    meta: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    """An HF-style config dict equivalent to the GGUF metadata.

    tensor_shapes: numpy shapes of the file's tensors (vocab from token_embd, tying from output.weight);
    rope_freqs: the de-quantized `rope_freqs.weight` tensor when the file has one (llama3 rope scaling)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise ConfigError(f"GGUF metadata lacks required key {full!r}")
        return default

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_layers = int(key("block_count"))
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer head counts
        if len(set(n_kv)) != 1:
            raise ConfigError("GGUF files with per-layer KV head counts are not supported")
        n_kv = n_kv[0]
    head_dim = int(key("attention.key_length", hidden // n_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ConfigError("attention.value_length differs from attention.key_length, which is not supported")
    rotary_dim = int(key("rope.dimension_count", head_dim))  # < head_dim: partial rotary embedding
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"rope.dimension_count {rotary_dim} must be even and at most the head dim {head_dim}")
    if "token_embd.weight" in tensor_shapes:
        vocab = int(tensor_shapes["token_embd.weight"][0])
    elif "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        vocab = int(key("vocab_size"))
    theta = float(key("rope.freq_base", 10000.0))
    scaling = str(key("rope.scaling.type", "none"))
    rope: dict[str, Any] = {}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling == "yarn":
        rope = _yarn_rope(key, arch)
    elif scaling not in ("none", ""):
        rope = {"rope_type": scaling}  # from_hf_dict rejects it with the list of supported types
    elif rope_freqs is not None:
        orig = key("rope.scaling.original_context_length", None)
        rope = _llama3_rope_from_factors(rope_freqs, theta, rotary_dim, orig)

    eos_ids = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if k in meta and int(meta[k]) not in eos_ids:
            eos_ids.append(int(meta[k]))
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", key("attention.layer_norm_epsilon", 1e-6))),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": _ACTIVATIONS.get(arch, "silu"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
    }
    if rotary_dim != head_dim:
        d["partial_rotary_factor"] = _partial_rotary_factor(rotary_dim, head_dim)
    d.update(_mixture_of_experts(key, arch, n_layers, tensor_shapes))
    if arch == "gptneox":
        d["use_parallel_residual"] = bool(key("use_parallel_residual", True))
    if arch not in _GEMMA_SWA_PATTERN:
        d["rope_theta"] = theta
        d["rope_scaling"] = rope or None
        return d

    window = key("attention.sliding_window", None)
    pattern = key("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch])
    if isinstance(pattern, list):  # per layer: true = sliding window
        if len(pattern) != n_layers:
            raise ConfigError(f"sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(n_layers)]
    if not window:
        sliding = [False] * n_layers
    scale = key("attention.scale", None)
    if scale is not None:
        pre_attn = float(scale) ** -2
    else:
        pre_attn = hidden // n_heads if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    sliding_theta = float(key("rope.freq_base_swa", _GEMMA3_SWA_THETA if arch == "gemma3" else theta))
    d.update(
        sliding_window=int(window) if window else None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={
            "full_attention": {"rope_theta": theta, "rope_type": "default", **rope},
            "sliding_attention": {"rope_theta": sliding_theta},
        },
        query_pre_attn_scalar=pre_attn,
        attn_logit_softcapping=key("attn_logit_softcapping", None),
        final_logit_softcapping=key("final_logit_softcapping", None),
    )
    return d


def config_from_gguf_metadata(
    meta: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
) -> ModelConfig:
    """ModelConfig of a GGUF file (see `gguf_to_hf_config`)."""
    return ModelConfig.from_hf_dict(gguf_to_hf_config(meta, tensor_shapes, rope_freqs))


def _mixture_of_experts(key: Callable[..., Any], arch: str, n_layers: int, shapes: dict[str, tuple[int, ...]]) -> dict:
    """HF config fields of a mixture-of-experts GGUF (none for a dense one), as llama.cpp's converter writes them:
    `expert_count`, `expert_used_count`, `expert_feed_forward_length` (Qwen3-MoE's expert width; gpt-oss and
    Mixtral use `feed_forward_length`). Mixtral is arch "llama" with experts. Qwen3-MoE: llama.cpp always
    renormalises the top-k weights unless `expert_weights_norm` says otherwise, and a layer without a router
    (`ffn_gate_inp`) is a dense one (mlp_only_layers). gpt-oss: its layers alternate sliding (even) and full
    attention, as llama.cpp's set_swa_pattern(2) and the HF config's default layer_types both say; the SwiGLU
    clamp and slope are llama.cpp's constants (7.0, 1.702), which the HF config defaults to too."""
    n_experts = int(key("expert_count", 0))
    if not n_experts:
        return {}
    d: dict[str, Any] = {"num_local_experts": n_experts, "num_experts_per_tok": int(key("expert_used_count"))}
    if arch == "llama":
        d["architectures"] = ["MixtralForCausalLM"]
    elif arch == "qwen3moe":
        d["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
        d["norm_topk_prob"] = bool(key("expert_weights_norm", True))
        if any(n.endswith(".ffn_gate_inp.weight") for n in shapes):
            d["mlp_only_layers"] = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    elif arch == "gpt-oss":
        if (width := key("expert_feed_forward_length", None)) is not None:
            d["intermediate_size"] = int(width)
        if window := key("attention.sliding_window", None):
            d["sliding_window"] = int(window)
            d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    return d
