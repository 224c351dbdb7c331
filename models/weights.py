"""Weight map: Hugging Face tensor names -> the parameter pytree of `models.transformer`, with the transposes,
gate/up stacking and Gemma (1 + w) norm folding done once at load time."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from netra_jax.config import ModelConfig

# get(name) -> numpy array (any float dtype); has(name) -> bool
Getter = Callable[[str], np.ndarray]


class WeightError(ValueError):
    """A checkpoint lacks a tensor the model needs, or a tensor has the wrong shape."""


def hf_to_params(cfg: ModelConfig, get: Getter, has: Callable[[str], bool], dtype) -> dict:
    """Build the parameter pytree (numpy arrays in `dtype`, norms in float32) from HF-named tensors."""

    def t(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if not has(name):
            raise WeightError(f"checkpoint lacks tensor {name!r}")
        a = get(name)
        if tuple(a.shape) != shape:
            raise WeightError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a

    def lin(name: str, n_out: int, n_in: int) -> np.ndarray:  # HF stores [out, in]; we keep [in, out]
        return np.ascontiguousarray(t(name, (n_out, n_in)).T).astype(dtype)

    def norm(name: str, dim: int) -> np.ndarray:
        w = t(name, (dim,)).astype(np.float32)
        return (1.0 + w) if cfg.norm_weight_offset else w

    def opt_bias(name: str, dim: int):
        return t(name, (dim,)).astype(dtype) if has(name) else None

    H, V, I, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    qs, ks = cfg.q_size, cfg.kv_size
    embed = t("model.embed_tokens.weight", (V, H)).astype(dtype)
    if has("lm_head.weight") and not cfg.tie_word_embeddings:
        lm_head = lin("lm_head.weight", V, H)
    elif cfg.tie_word_embeddings:
        lm_head = np.ascontiguousarray(embed.T)
    else:
        raise WeightError("checkpoint lacks 'lm_head.weight' and does not tie word embeddings")
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lp = {
            "attn_norm": norm(p + "input_layernorm.weight", H),
            "wq": lin(p + "self_attn.q_proj.weight", qs, H),
            "wk": lin(p + "self_attn.k_proj.weight", ks, H),
            "wv": lin(p + "self_attn.v_proj.weight", ks, H),
            "wo": lin(p + "self_attn.o_proj.weight", H, qs),
            "w_gate_up": np.stack(
                [lin(p + "mlp.gate_proj.weight", I, H), lin(p + "mlp.up_proj.weight", I, H)], axis=1
            ),  # [H, 2, I]
            "w_down": lin(p + "mlp.down_proj.weight", H, I),
        }
        for short, name, dim in (("bq", "q_proj", qs), ("bk", "k_proj", ks), ("bv", "v_proj", ks), ("bo", "o_proj", H)):
            b = opt_bias(p + f"self_attn.{name}.bias", dim)
            if b is not None:
                lp[short] = b
        if cfg.qk_norm:
            lp["q_norm"] = norm(p + "self_attn.q_norm.weight", D)
            lp["k_norm"] = norm(p + "self_attn.k_norm.weight", D)
        if cfg.sandwich_norms:
            lp["post_attn_norm"] = norm(p + "post_attention_layernorm.weight", H)
            lp["mlp_norm"] = norm(p + "pre_feedforward_layernorm.weight", H)
            lp["post_mlp_norm"] = norm(p + "post_feedforward_layernorm.weight", H)
        else:
            lp["mlp_norm"] = norm(p + "post_attention_layernorm.weight", H)
        layers.append(lp)
    return {"embed": embed, "lm_head": lm_head, "final_norm": norm("model.norm.weight", H), "layers": layers}
