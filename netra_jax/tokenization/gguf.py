"""GGUF tokenizers: read a GGUF file's key/value metadata and rebuild its tokenizer (byte-level BPE here, SentencePiece
in tokenizer_gguf_spm). Produces a `tokenizers.Tokenizer` and the special tokens / chat templates stored beside it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from netra_jax.tokenization.gguf_spm import spm_tokenizer

log = logging.getLogger(__name__)

# Pre-tokenization per `tokenizer.ggml.pre`, as llama.cpp's src/llama-vocab.cpp maps the names (llama_vocab::impl::load)
# and splits text (llm_tokenizer_bpe: each regex splits the pieces of the one before). Where llama.cpp runs an
# adaptation of a regex for std::regex (for "gpt-4o" and "tekken" it treats every non-ASCII letter as both upper and
# lower case and combining marks as punctuation), the original it quotes from the model's tokenizer.json is used: the
# split the model was trained with.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (  # Mistral Nemo, Mistral Small 3
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (  # o200k: gpt-oss
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreStyle:
    """One of llama.cpp's LLAMA_VOCAB_PRE_TYPE_* for byte-level BPE."""

    splits: tuple[str, ...]  # regexes applied in turn, each isolating its matches in the pieces of the one before
    nfc: bool = False  # NFC before splitting, as the model's tokenizer.json (llama.cpp does not)
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (llama.cpp's `ignore_merges`)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreStyle((_GPT2_SPLIT,))
_LLAMA3 = _PreStyle((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreStyle((_QWEN2_SPLIT,), nfc=True)
_DIGITS = _PreStyle((r"\p{N}", _GPT2_SPLIT))
_PRE_STYLES = {
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: its choice for a file without tokenizer.ggml.pre, too
    "default": _PreStyle((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(["gpt2", "gpt-2", "mpt", "olmo", "jais", "exaone4"], _GPT2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"], _DIGITS),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], _LLAMA3),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"], _QWEN2),
    "tekken": _PreStyle((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    "gpt-4o": _PreStyle((_GPT4O_SPLIT,)),
}


def _pre_style(meta: Mapping[str, Any], source: str) -> _PreStyle:
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        log.warning("%s: GGUF metadata lacks tokenizer.ggml.pre; splitting text as llama.cpp's 'default'", source)
        pre = "default"
    if pre not in _PRE_STYLES:
        raise ValueError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_STYLES)}")
    return _PRE_STYLES[pre]


def _gguf_pre_tokenizer(style: _PreStyle) -> tuple[Any, Any]:
    """The normalizer (or None) and pre-tokenizer of a pre-tokenization style."""
    splits = [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated", invert=False) for r in style.splits]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    return (normalizers.NFC() if style.nfc else None), pre_tokenizers.Sequence([*splits, byte_level])


def _byte_level_tokenizer(
    meta: Mapping[str, Any], tokens: list[str], style: _PreStyle, source: str
) -> tokenizers.Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{source}: malformed BPE merge in tokenizer.ggml.merges")
    bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=style.ignore_merges)
    tok = tokenizers.Tokenizer(bpe)
    normalizer, pre_tokenizer = _gguf_pre_tokenizer(style)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# llama.cpp's end-of-generation texts (src/llama-vocab.cpp, the special_eog_ids loop)
_EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    ]
)


def end_of_generation_ids(tokens: list[str]) -> list[int]:
    """Ids that end generation by their text, as llama.cpp adds them to its end-of-generation set (llama-vocab.cpp,
    `special_eog_ids`): converters do not always write an eot key (Gemma 3's <end_of_turn>, gpt-oss's <|return|> and
    <|call|>). As there, <|end|> closes a message but not the turn in the harmony format (<|return|> with <|call|>)
    and in solar-open's (<|calls|> with <|flush|>), so it is left out then."""
    found = {t: i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    calls = "<|call|>" in found or "<|calls|>" in found
    if calls and ("<|return|>" in found or "<|flush|>" in found):
        found.pop("<|end|>", None)
    return sorted(found.values())


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
        bos_by_default = True
    else:
        style = _pre_style(meta, source)
        tok, spelled = _byte_level_tokenizer(meta, tokens, style, source), tokens
        bos_by_default = style.add_bos
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
    ends += end_of_generation_ids(tokens)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bos_by_default)  # llama.cpp's default where the file is silent
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
