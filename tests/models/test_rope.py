"""RoPE against transformers: YaRN / linear / llama3 frequencies and cos-sin scaling parsed from HF configs (and
GGUF metadata), and the partial-rotary rotation, all checked against tests/fixtures/tiny-yarn/reference.json."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import DATA

from netra_jax.config import ConfigError, ModelConfig, RopeConfig
from netra_jax.loader.gguf_config import config_from_gguf_metadata
from netra_jax.models.rope import attention_scaling, inv_freq, rope

TINY_YARN = DATA / "tiny-yarn"
REF = json.loads((TINY_YARN / "reference.json").read_text())
ROPE_CONFIGS = {k: v for k, v in REF["rope_configs"].items() if k != "tiny-gpt-oss"}
VARIANT = REF["variants"]["yarn_untruncated_explicit_attention_factor"]["rope_parameters"]
VARIANT_WITHOUT_TRUNCATE = {k: v for k, v in VARIANT.items() if k != "truncate"}  # GGUF has no truncate key


def model_config(d: dict) -> ModelConfig:
    """Our config of one of the generator's Llama-shaped HF config dicts."""
    base = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 64}
    return ModelConfig.from_hf_dict({**base, **d})


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_inv_freq_and_attention_scaling_match_transformers(name):
    want = ROPE_CONFIGS[name]
    cfg = model_config(want["config"])
    rc = cfg.rope_full
    assert cfg.rotary_dim == 2 * len(want["inv_freq"])
    # transformers computes the frequencies in float32, we in float64 (then the forward rounds them to float32)
    np.testing.assert_allclose(inv_freq(rc, cfg.rotary_dim), want["inv_freq"], rtol=1e-6, atol=0)
    assert attention_scaling(rc) == pytest.approx(want["attention_scaling"], rel=1e-12)


def test_tiny_gpt_oss_rope_parameters():
    want = REF["rope_configs"]["tiny-gpt-oss"]
    d = want["config"]
    rc = RopeConfig.from_dict(d["rope_parameters"], max_position_embeddings=d["max_position_embeddings"])
    assert (rc.rope_type, rc.factor, rc.original_max_position_embeddings, rc.truncate) == ("yarn", 8.0, 64, False)
    np.testing.assert_allclose(inv_freq(rc, d["head_dim"]), want["inv_freq"], rtol=1e-6, atol=0)
    assert attention_scaling(rc) == pytest.approx(want["attention_scaling"], rel=1e-12)
    cfg = ModelConfig.from_hf_dict(d)  # the same setting on both its sliding and full layers
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.rotary_dim == d["head_dim"]
    assert cfg.layer_rope(0) == cfg.layer_rope(1) == rc


def test_truncate_and_betas_change_the_ramp():
    """The reference pairs differ only in `truncate` / the betas; a parser that drops the field cannot match both."""
    a, b = (ROPE_CONFIGS[n] for n in ("yarn_gpt_oss_style_untruncated", "yarn_truncated_same"))
    assert not np.allclose(a["inv_freq"], b["inv_freq"], rtol=1e-3)
    got = [model_config(r["config"]).rope_full for r in (a, b)]
    assert (got[0].truncate, got[1].truncate) == (False, True)


@pytest.mark.parametrize("name", sorted(REF["apply_cases"]))
def test_rotation_matches_transformers_partial_rotary_apply(name):
    case = REF["apply_cases"][name]
    cfg = model_config(case["config"])
    x = np.asarray(case["x"], np.float32)  # [T, heads, head_dim]
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(case["positions"], jnp.int32), cfg.rope_full, cfg.rotary_dim))
    np.testing.assert_allclose(got, case["out"], rtol=0, atol=2e-5)
    r = cfg.rotary_dim
    np.testing.assert_array_equal(got[..., r:], x[..., r:])  # the dims past rotary_dim pass through untouched
    if r < cfg.head_dim:
        assert not np.allclose(got[..., :r], x[..., :r], atol=1e-3)


def test_rotation_keeps_dtype_and_rejects_bad_rotary_dim():
    x = jnp.ones((3, 2, 16), jnp.bfloat16)
    pos = jnp.arange(3, dtype=jnp.int32)
    assert rope(x, pos, RopeConfig(), 8).dtype == jnp.bfloat16
    for bad in (0, 7, 18):
        with pytest.raises(ValueError, match="rotary_dim"):
            rope(x, pos, RopeConfig(), bad)


def test_config_errors():
    base = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    with pytest.raises(ConfigError, match="unsupported rope type 'dynamic'.*yarn"):
        model_config({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="needs max_position_embeddings"):
        RopeConfig.from_dict({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64})
    for bad in (0.3125, 1.5):  # 5 rotary dims (odd), 24 of 16
        with pytest.raises(ConfigError, match="partial_rotary_factor"):
            model_config({**base, "partial_rotary_factor": bad})


# ----------------------------------------------------------------------------------------------------- GGUF


def gguf_metadata(hf: dict, arch: str) -> dict:
    """llama.cpp convert_hf_to_gguf.py's metadata for a HF config (the keys the config needs, YaRN included)."""
    rp = hf["rope_parameters"]
    meta = {
        "general.architecture": arch,
        f"{arch}.context_length": hf["max_position_embeddings"],
        f"{arch}.embedding_length": hf["hidden_size"],
        f"{arch}.block_count": hf["num_hidden_layers"],
        f"{arch}.feed_forward_length": hf["intermediate_size"],
        f"{arch}.attention.head_count": hf["num_attention_heads"],
        f"{arch}.attention.head_count_kv": hf["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        f"{arch}.attention.key_length": hf["head_dim"],
        f"{arch}.attention.value_length": hf["head_dim"],
        f"{arch}.rope.dimension_count": int(hf["head_dim"] * hf.get("partial_rotary_factor", 1.0)),
        f"{arch}.rope.freq_base": rp["rope_theta"],
        "tokenizer.ggml.eos_token_id": hf["eos_token_id"],
    }
    if rp["rope_type"] == "yarn":
        meta |= {
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": rp["factor"],
            f"{arch}.rope.scaling.original_context_length": rp["original_max_position_embeddings"],
        }
        for hf_key, gguf_key in (
            ("attention_factor", "yarn_attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if hf_key in rp:
                meta[f"{arch}.rope.scaling.{gguf_key}"] = rp[hf_key]
    return meta


def tiny_yarn_config(**changes) -> dict:
    return {**json.loads((TINY_YARN / "config.json").read_text()), **changes}


def shapes(hf: dict) -> dict:
    return {"token_embd.weight": (hf["vocab_size"], hf["hidden_size"]), "output.weight": (0, 0)}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"rope_parameters": VARIANT_WITHOUT_TRUNCATE},
        {"partial_rotary_factor": 0.5},
        {"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    ],
    ids=["yarn", "yarn_betas_attention_factor", "yarn_partial_rotary", "default_partial_rotary"],
)
def test_gguf_rope_metadata_gives_the_hf_config(changes):
    hf = tiny_yarn_config(**changes)
    want = ModelConfig.from_hf_dict(hf)
    got = config_from_gguf_metadata(gguf_metadata(hf, "qwen3"), shapes(hf))
    assert (got.rope_full, got.rope_sliding, got.rotary_dim) == (want.rope_full, want.rope_sliding, want.rotary_dim)
    assert got.rotary_dim == int(hf["head_dim"] * hf.get("partial_rotary_factor", 1.0))


@pytest.mark.parametrize("rotary_dim, head_dim", [(30, 44), (26, 46), (2, 49), (24, 48)])
def test_gguf_partial_rotary_dims_survive_the_factor(rotary_dim, head_dim):
    """n / d * d can round below n in floating point: the factor written for the config must still give n dims."""
    hf = tiny_yarn_config(head_dim=head_dim)
    meta = gguf_metadata(hf, "qwen3") | {"qwen3.rope.dimension_count": rotary_dim}
    assert config_from_gguf_metadata(meta, shapes(hf)).rotary_dim == rotary_dim


def test_gguf_llama_cpp_attention_keys():
    """llama.cpp's own YaRN scale keys: `yarn_log_multiplier` is mscale_all_dim with mscale 1, and
    `rope.scaling.attn_factor` multiplies the scale (llama-context.cpp)."""
    hf = tiny_yarn_config()
    meta = gguf_metadata(hf, "qwen3")
    factor = hf["rope_parameters"]["factor"]

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0

    rc = config_from_gguf_metadata(meta | {"qwen3.rope.scaling.yarn_log_multiplier": 0.5}, shapes(hf)).rope_full
    assert attention_scaling(rc) == pytest.approx(mscale(1.0) / mscale(0.5), rel=1e-12)
    rc = config_from_gguf_metadata(meta | {"qwen3.rope.scaling.attn_factor": 0.9}, shapes(hf)).rope_full
    assert attention_scaling(rc) == pytest.approx(mscale(1.0) * 0.9, rel=1e-12)
    assert inv_freq(rc, 16) == inv_freq(ModelConfig.from_hf_dict(hf).rope_full, 16)


def test_gguf_rope_errors():
    hf = tiny_yarn_config()
    meta = gguf_metadata(hf, "qwen3")
    with pytest.raises(ConfigError, match="extrapolation factor"):
        config_from_gguf_metadata(meta | {"qwen3.rope.scaling.yarn_ext_factor": 0.5}, shapes(hf))
    for bad in (7, 18, 0):
        with pytest.raises(ConfigError, match="rope.dimension_count"):
            config_from_gguf_metadata(meta | {"qwen3.rope.dimension_count": bad}, shapes(hf))


def test_gguf_gpt_oss_keeps_its_unrounded_yarn_ramp():
    """gpt-oss GGUF files carry no `truncate` key; the HF config's truncate=false is what the weights were made for."""
    hf = REF["rope_configs"]["tiny-gpt-oss"]["config"]
    moe = {"expert_count": hf["num_local_experts"], "expert_used_count": hf["num_experts_per_tok"]}
    meta = gguf_metadata(hf, "gpt-oss") | {f"gpt-oss.{k}": v for k, v in moe.items()}
    meta["gpt-oss.attention.sliding_window"] = hf["sliding_window"]
    got, want = config_from_gguf_metadata(meta, shapes(hf)), ModelConfig.from_hf_dict(hf)
    assert not got.rope_full.truncate
    assert (got.rope_full, got.rope_sliding, got.rotary_dim) == (want.rope_full, want.rope_sliding, want.rotary_dim)


def test_yarn_extends_the_served_context():
    """Qwen3's long-context recipe adds YaRN (factor 4 over 32768) and keeps max_position_embeddings at 40960: the
    model serves original x factor tokens; a longer max_model_len is refused, not silently cut."""
    from support.checkpoints import FIXTURES

    from netra_jax import LLM

    hf = tiny_yarn_config()
    hf["max_position_embeddings"] = 40960
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict(hf).max_context == 131072
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert ModelConfig.from_hf_dict(hf).max_context == 40960
    with pytest.raises(ValueError, match="longer than the model's context of 512"):
        LLM(str(FIXTURES / "tiny-llama"), max_model_len=513, warmup=False)
    assert LLM(str(FIXTURES / "tiny-llama"), max_model_len=512, warmup=False).engine.max_model_len == 512
