"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, TinyLlama, Gemma) rebuilt as a
`tokenizers` BPE with byte fallback, merged by token score and prefixed with `▁` the way llama.cpp tokenizes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # SentencePiece's visible space
# Gemma files are converted with whitespace-run tokens spelled as real spaces ("  ") and scores that do not follow the
# merge order; like transformers' GGUF converter, respell those tokens and rank merges by position in the file.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_MERGEABLE = (TokenType.NORMAL, TokenType.USER_DEFINED)  # control, unknown, unused and byte tokens never come from text


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging (llama.cpp's SPM tokenizer).

    Every split of a mergeable token into two vocabulary tokens is a merge ranked by the token's score (higher
    first), then by the longer left and right part; ties keep vocabulary order. This is the order transformers'
    `generate_merges` gives, so both tokenize a file alike."""
    vocab = {tok: i for i, tok in enumerate(tokens)}  # the last of duplicate spellings wins, as in llama.cpp
    found: list[tuple[float, str, str]] = []
    for tok, i in vocab.items():
        if types[i] not in _MERGEABLE:
            continue
        splits = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((scores[i], left, right) for left, right in splits)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _respell_gemma(tokens: Sequence[str]) -> list[str]:
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def spm_tokenizer(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], source: str
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """The `tokenizers.Tokenizer` of a SentencePiece GGUF vocabulary and the token spellings it uses.

    Encoding follows llama.cpp: every span of text between special tokens (and the text's start) gets a `▁` prefix
    when `tokenizer.ggml.add_space_prefix` is set (the default, except for Gemma), spaces become `▁`, and characters
    outside the vocabulary fall back to `<0xNN>` byte tokens. For plain text this is exactly SentencePiece's own
    encoding (`add_dummy_prefix`); transformers' GGUF converter differs on text that starts with a space (it adds no
    second `▁`) and on text right after a special token (it adds none). Decoding drops the prefix space again."""
    arch = meta.get("general.architecture")
    gemma = arch in _GEMMA_ARCHS
    spelled = _respell_gemma(tokens) if gemma else list(tokens)
    vocab = {tok: i for i, tok in enumerate(spelled)}
    if meta.get("tokenizer.ggml.merges") is not None:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        if any(len(m) != 2 for m in merges):
            raise ValueError(f"{source}: malformed BPE merge in tokenizer.ggml.merges")
    else:
        if gemma:
            ranks: Sequence[float] = [-float(i) for i in range(len(spelled))]
        else:
            ranks = meta.get("tokenizer.ggml.scores") or []
            if len(ranks) != len(spelled):
                raise ValueError(f"{source}: {len(ranks)} tokenizer.ggml.scores for {len(spelled)} tokens")
        merges = merges_from_scores(spelled, ranks, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None or not 0 <= unk_id < len(spelled):
        unk_id = next((i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    unk = None if unk_id is None else spelled[unk_id]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok, spelled
