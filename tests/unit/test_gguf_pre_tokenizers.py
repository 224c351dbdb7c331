"""GGUF byte-level BPE pre-tokenization per `tokenizer.ggml.pre`: each style splits text as llama.cpp's regexes do
(checked with the `regex` module), a gpt-oss ("gpt-4o") vocabulary tokenizes end to end, and llama.cpp's per-style
defaults (whole-piece lookup, BOS) hold."""

from __future__ import annotations

import pytest
import regex
import tokenizers
from gguf import GGUFWriter
from test_tokenizer import FIXTURES, _write_tiny_gguf
from tokenizers import decoders, pre_tokenizers

from netra_jax.tokenization.gguf import _PRE_STYLES, _gguf_pre_tokenizer, tokenizer_from_gguf_metadata
from netra_jax.tokenization.tokenizer import Tokenizer

# The split regexes of llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe, per LLAMA_VOCAB_PRE_TYPE_*), copied from
# there: where llama.cpp runs an adaptation of the regex for std::regex, the original it quotes from the model's
# tokenizer.json (which is what the model was trained with). GPT-2's is the one quoted in src/unicode.cpp
# (unicode_regex_split_custom_gpt2, whose code also applies the final `\s+`).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA_CPP_SPLITS = {
    "gpt2": [GPT2],
    "smollm": [r"\p{N}", GPT2],  # LLAMA_VOCAB_PRE_TYPE_SMOLLM (with STARCODER, REFACT, COMMAND_R, ...)
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "llama-bpe": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ],
    "qwen2": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ],
    "tekken": [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "gpt-4o": [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}
TEXTS = [
    "Hello world! The capital of France is Paris.",
    "I'M HERE, DON'T GO; we'll see what they've done, I'd say it's fine",
    "HelloWorld XMLHttpRequest camelCase snake_case CONSTANT_NAME",
    "ÉCOLE école àÉ Straße STRAßE ǅungla ʰmodifier",
    "e\u0301 combining marks: नमस्ते दुनिया, ภาษาไทย",
    "digits 1234567890, 3.14159 and ٣٤٥٦ and ½ⅷ",
    "path/to/file.txt //comment\n/next line/\n",
    "tabs\t\tand  spaces  \n  \n\n trailing   ",
    "\r\nwindows\r\nlines\r\n",
    "你好，世界。中文 and English 123 😀 end",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧",
    "price: $5+3=<8>^~|` {x} [y] (z) @user #tag 100%",
    "   indented\n\tcode(x) -> y",
    "rare glyphs ∑∫√ Ω≈ç ꙮ 𝄞",
    "",
    " ",
    "\n",
]


def _llama_cpp_split(patterns: list[str], text: str) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex splits every piece of the one before into its matches and the
    text between them."""
    pieces = [text] if text else []
    for pattern in patterns:
        out = []
        for piece in pieces:
            end = 0
            for m in regex.finditer(pattern, piece):
                out += [piece[end : m.start()], m.group()]
                end = m.end()
            out.append(piece[end:])
        pieces = [p for p in out if p]
    return pieces


def _our_split(pre: str, text: str) -> list[str]:
    normalizer, pre_tokenizer = _gguf_pre_tokenizer(_PRE_STYLES[pre])
    if normalizer is not None:
        text = normalizer.normalize_str(text)
    byte_level = decoders.ByteLevel()
    return [byte_level.decode([piece]) for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_SPLITS))
def test_pre_tokenizer_splits_as_llama_cpp(pre: str) -> None:
    for text in TEXTS:
        reference = text if pre != "qwen2" else tokenizers.normalizers.NFC().normalize_str(text)  # as Qwen2's HF file
        assert _our_split(pre, text) == _llama_cpp_split(LLAMA_CPP_SPLITS[pre], reference), repr(text)


def test_names_that_share_a_style() -> None:
    for alias, style in [("llama3", "llama-bpe"), ("pixtral", "llama-bpe"), ("starcoder", "smollm")]:
        for text in TEXTS:
            assert _our_split(alias, text) == _our_split(style, text)


def _whole_piece_bpe() -> tokenizers.Tokenizer:
    """tiny-llama's BPE applied to a whole piece (no split of its own), to tokenize llama.cpp's pieces one by one."""
    tok = tokenizers.Tokenizer.from_file(str(FIXTURES / "tiny-llama" / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.post_processor = None
    return tok


def test_gpt_4o_vocabulary_tokenizes_end_to_end(tmp_path) -> None:
    """gpt-oss GGUF files say `tokenizer.ggml.pre = "gpt-4o"`: the file loads, each of llama.cpp's pieces is
    byte-pair encoded on its own, and decoding gives the text back."""
    tok = Tokenizer.load(_write_tiny_gguf(tmp_path / "gpt-4o.gguf", pre="gpt-4o"))
    whole = _whole_piece_bpe()
    for text in TEXTS:
        pieces = _llama_cpp_split(LLAMA_CPP_SPLITS["gpt-4o"], text)
        expected = [i for piece in pieces for i in whole.encode(piece, add_special_tokens=False).ids]
        assert tok.encode(text) == expected, repr(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user") == [1, *tok.encode("user")]
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, 0)  # the file's <|im_end|>, then <|endoftext|> by its text as llama.cpp


def _bpe_gguf(path, pre: str | None, add_bos: bool | None) -> Tokenizer:
    """A five-token vocabulary whose merges never build "abc", though it is a token."""
    tokens = ["a", "b", "c", "bc", "abc", "<s>"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(["b c"])
    writer.add_token_types([1] * 5 + [3])
    writer.add_bos_token_id(5)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return Tokenizer.load(path)


@pytest.mark.parametrize(
    "pre, whole, bos", [("llama-bpe", True, True), ("tekken", True, True), ("gpt-4o", False, False)]
)
def test_llama_cpp_per_style_defaults(tmp_path, pre: str, whole: bool, bos: bool) -> None:
    """llama.cpp's `ignore_merges` (a piece that is a token is taken whole) and its BOS default when the file does not
    say `tokenizer.ggml.add_bos_token`, for the styles that set them (src/llama-vocab.cpp, llama_vocab::impl::load)."""
    tok = _bpe_gguf(tmp_path / "default.gguf", pre, add_bos=None)
    assert tok.encode("abc", add_special_tokens=False) == ([4] if whole else [0, 3])
    assert tok.encode("abc")[:1] == ([5] if bos else tok.encode("abc", add_special_tokens=False)[:1])
    assert _bpe_gguf(tmp_path / "no-bos.gguf", pre, add_bos=False).encode("abc")[0] != 5


def test_a_file_without_a_pre_tokenizer_splits_as_llama_cpp_default(tmp_path, caplog) -> None:
    with caplog.at_level("WARNING", logger="netra_jax.tokenization.gguf"):
        tok = _bpe_gguf(tmp_path / "no-pre.gguf", None, add_bos=None)
    assert "lacks tokenizer.ggml.pre" in caplog.text
    for text in TEXTS:
        pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
        assert [decoders.ByteLevel().decode([p]) for p in pieces] == _llama_cpp_split(LLAMA_CPP_SPLITS["default"], text)


def _eog_ids(tokens: list[str], **keys: int) -> tuple[int, ...]:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [3 if t.startswith("<") else 1 for t in tokens],
    }
    meta |= {f"tokenizer.ggml.{k}_token_id": v for k, v in keys.items()}
    return tokenizer_from_gguf_metadata(meta, "test")[1]["eos_token_ids"]


def test_end_of_generation_tokens_found_by_text_as_llama_cpp() -> None:
    """llama.cpp's converter writes no eot key for Gemma 3, whose turns end with <end_of_turn>; gpt-oss ends with
    <|return|> or <|call|>, where <|end|> only closes a message (src/llama-vocab.cpp, special_eog_ids)."""
    gemma = ["<pad>", "<eos>", "<bos>", "a", "<end_of_turn>"]
    assert _eog_ids(gemma, eos=1, bos=2) == (1, 4)
    harmony = ["a", "<|endoftext|>", "<|end|>", "<|return|>", "<|call|>", "<|start|>"]
    assert _eog_ids(harmony, eos=3) == (3, 1, 4)
    assert _eog_ids(["a", "<|end|>", "<|im_end|>", "b"], eos=2) == (2, 1)  # <|end|> ends a turn elsewhere
    assert _eog_ids(["a", "b", "c"]) == ()
