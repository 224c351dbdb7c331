"""The model directory the model, serve and peers sections share: a Llama-3.1-8B config.json (a tiny Llama in the
dry run) and a synthetic tokenizer, no weights (`--load-format dummy` draws them). The tokenizer is a WordLevel
vocabulary "w0" .. "w<vocab-1>" split on whitespace and decoded with spaces, so every id is a token and text <-> ids
round-trips exactly (the serving benchmark's random prompts detokenize and re-tokenize to the same length)."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
TINY = LLAMA31_8B | {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rope_scaling": None,
}


def model_config(dry: bool) -> dict:
    return TINY if dry else LLAMA31_8B


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "w0", "eos_token": "w1", "model_max_length": 131072}
    config["tokenizer_class"] = "PreTrainedTokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def ensure_model_dir(work: Path, dry: bool) -> Path:
    """work/model with config.json and the tokenizer (written once, reused by later sections)."""
    path = work / "model"
    if (path / "tokenizer.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_config(dry)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_tokenizer(path, cfg["vocab_size"])
    return path


def weight_bytes(cfg: dict, itemsize: int = 2) -> int:
    """Bytes of every weight a decode step reads (embedding rows aside: one row per token), lm_head included."""
    H, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * I
    return (L * per_layer + H * V) * itemsize


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    """K and V of one token over all layers."""
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * D * itemsize
