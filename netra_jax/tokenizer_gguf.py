"""GGUF tokenizers: read a GGUF file's key/value metadata and rebuild its tokenizer (byte-level BPE here, SentencePiece
in tokenizer_gguf_spm). Produces a `tokenizers.Tokenizer` and the special tokens / chat templates stored beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from netra_jax.tokenizer_gguf_spm import spm_tokenizer

# Pre-tokenization per `tokenizer.ggml.pre`, as llama.cpp applies it (its names; regexes from the HF files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_STYLES = {
    **dict.fromkeys(["gpt2", "gpt-2", "default", "mpt", "olmo", "jais", "exaone4"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"], "digits"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"], "qwen2"),
}


def _gguf_pre_tokenizer(pre: str) -> tuple[Any, Any]:
    style = _PRE_STYLES.get(pre)
    if style is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_STYLES)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=style != "llama3")
    if style == "gpt2":
        return None, byte_level
    if style == "digits":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = pre_tokenizers.Split(
        tokenizers.Regex(_LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT), behavior="isolated", invert=False
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    return (normalizers.NFC() if style == "qwen2" else None), pre_tokenizers.Sequence([split, byte_level])


def _byte_level_tokenizer(meta: Mapping[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{source}: malformed BPE merge in tokenizer.ggml.merges")
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    normalizer, pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], source: str) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The tokenizer and the `SpecialTokens` fields (tokens, ids, chat templates by name) of GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _KINDS:
        known = ", ".join(f"{k!r} ({v})" for k, v in _KINDS.items())
        raise ValueError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: {known}); "
            "load the model's Hugging Face directory (tokenizer.json) instead"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "llama":
        tok, spelled = spm_tokenizer(meta, tokens, types, source)
    else:
        tok, spelled = _byte_level_tokenizer(meta, tokens, source), tokens
    # Control and unknown tokens are matched whole in text and dropped by skip_special_tokens; user-defined ones are
    # matched whole but kept (a token Gemma's converter respelled is reached through merges instead, as transformers).
    added = [
        AddedToken(tokens[i], special=t != TokenType.USER_DEFINED, normalized=False)
        for i, t in enumerate(types)
        if t in (TokenType.UNKNOWN, TokenType.CONTROL) or (t == TokenType.USER_DEFINED and spelled[i] == tokens[i])
    ]
    tok.add_tokens(added)

    def token_at(key: str) -> tuple[str | None, int | None]:
        i = meta.get(key)
        if i is None or not 0 <= i < len(tokens):
            return None, None
        return tokens[i], int(i)

    (bos, bos_id), (eos, eos_id), (pad, pad_id) = (
        token_at(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")
    )
    ends = [token_at(f"tokenizer.ggml.{k}_token_id")[1] for k in ("eos", "eot", "eom")]
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp's default: BOS for SentencePiece
    edges = [(bos, bos_id)] if add_bos and bos_id is not None else []
    tail = [(eos, eos_id)] if meta.get("tokenizer.ggml.add_eos_token") and eos_id is not None else []
    if edges or tail:
        single = " ".join([*(t for t, _ in edges), "$A", *(t for t, _ in tail)])
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=list({*edges, *tail}))
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    templates = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        templates["default"] = meta["tokenizer.chat_template"]
    for key, value in meta.items():
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    special = dict(
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=token_at("tokenizer.ggml.unknown_token_id")[0],
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(i for i in ends if i is not None)),
        pad_token_id=pad_id,
        chat_templates=templates,
    )
    return tok, special
