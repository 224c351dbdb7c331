"""Gemma 3 GGUF metadata: the hyperparameters llama.cpp's converter does not write get llama.cpp's defaults, and a
file's own keys win (a whole converted model with every key: test_loader.py's tiny-gemma3 GGUF test)."""

from __future__ import annotations

import pytest

from netra_jax.loader.gguf_config import config_from_gguf_metadata

HIDDEN, HEADS, HEAD_DIM = 128, 4, 16  # head_dim != hidden / heads, so the two query scales differ


def config(n_layers: int, **keys):
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": HIDDEN,
        "gemma3.attention.head_count": HEADS,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": HEAD_DIM,
        "gemma3.attention.value_length": HEAD_DIM,
        "gemma3.block_count": n_layers,
        "gemma3.feed_forward_length": 256,
        "gemma3.rope.freq_base": 1_000_000.0,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.sliding_window": 512,
    }
    meta.update({f"gemma3.{k}": v for k, v in keys.items()})
    return config_from_gguf_metadata({k: v for k, v in meta.items() if v is not None}, {"token_embd.weight": (96, 128)})


def kinds(cfg) -> str:  # "s" sliding, "f" full, per layer
    return "".join("s" if t == "sliding_attention" else "f" for t in cfg.layer_types)


def test_defaults_are_llama_cpps():
    cfg = config(13)
    assert kinds(cfg) == "sssssfsssssfs"  # period 6: layers 5 and 11 are global
    assert cfg.sliding_window == 512
    assert cfg.rope_sliding.theta == 10000.0 and cfg.rope_sliding.rope_type == "default"
    assert cfg.rope_full.theta == 1_000_000.0
    assert cfg.attn_scale == pytest.approx(HEAD_DIM**-0.5)
    assert config(62).attn_scale == pytest.approx((HIDDEN / HEADS) ** -0.5)  # the 27B's scale


def test_the_files_keys_win():
    cfg = config(8, **{"attention.sliding_window_pattern": 4, "rope.freq_base_swa": 20000.0, "attention.scale": 0.2})
    assert kinds(cfg) == "sssfsssf"
    assert cfg.rope_sliding.theta == 20000.0 and cfg.rope_full.theta == 1_000_000.0
    assert cfg.attn_scale == pytest.approx(0.2)
    per_layer = [True, False, False, True, True]
    assert kinds(config(5, **{"attention.sliding_window_pattern": per_layer})) == "sffss"
    assert kinds(config(4, **{"attention.sliding_window_pattern": 0})) == "ssss"  # llama.cpp: period 0, all slide


@pytest.mark.parametrize("window", [None, 0])
def test_no_sliding_window_means_no_sliding_layers(window):
    cfg = config(7, **{"attention.sliding_window": window})
    assert kinds(cfg) == "fffffff" and cfg.sliding_window is None
