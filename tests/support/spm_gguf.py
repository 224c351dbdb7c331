"""Tiny SentencePiece vocabularies trained on the spot and written into GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them (with tiny random llama weights), shared by the tests and the reference script."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

CONTROL_SYMBOLS = ("<|im_start|>", "<|im_end|>")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer turns text into token ids, and a detokenizer turns them back into text.",
    "Large language models predict the next token from the ones before it.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "The year 2024 had 366 days, and 1000 plus 24 is 1024.",
    "def main(argv): return sum(int(x) for x in argv)",
    "for i in range(10): print(i * i)",
    "She sells sea shells by the sea shore, then reads a book.",
    "Naïve café owners serve crème brûlée and jalapeño dishes.",
    "你好，世界。中文文本也可以被切分成词。",
    "こんにちは、世界。日本語のテキストです。",
    "Привет, мир! Это текст на русском языке.",
    "An inference server batches requests and streams tokens as they are generated.",
    "Key value caches keep attention states of earlier tokens in pages of memory.",
    "Hello there, how are you today? I am fine, thank you.",
    "Numbers like 3.14159, 2.71828 and 1.41421 appear in mathematics.",
    "    indented code lines start with four spaces",
    "the the the and and of of to to in in is is it it",
]
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    " leading space",
    "  two leading spaces",
    "multiple   inner    spaces",
    "trailing space ",
    "new\nline\n\nand\ttab\tstops",
    "\n starts with a newline",
    "digits 1234567890 and 3.14159",
    "你好，世界",
    "こんにちは世界",
    "Привет мир",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧",
    "naïve café crème",
    "rare glyphs ∑∫√ Ω≈ç ꙮ 𝄞",
    "mixed 中文 and English 123 😀 end",
    "def f(x):\n    return x ** 2",
    "",
    " ",
    "\n",
    "<|im_start|>user\nHi there<|im_end|>",
    "a<|im_end|>b",
    "x <|im_start|> y",
    "<s>Hello</s>",
    "<|im_start|><|im_end|>",
]


def train_spm(model_type: str, add_dummy_prefix: bool = True, vocab_size: int = 400) -> bytes:
    """A SentencePiece model proto set up as Llama's: identity normalization, no whitespace collapsing, split digits,
    byte fallback, `<unk> <s> </s>` at ids 0-2 and two control symbols."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=out,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        control_symbols=list(CONTROL_SYMBOLS),
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


def spm_vocab(proto: bytes) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types as convert_hf_to_gguf.py's `_create_vocab_sentencepiece` derives them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = TokenType.UNUSED
        elif sp.IsByte(i):
            kind = TokenType.BYTE
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(int(kind))
    return tokens, scores, types


def write_spm_gguf(
    path: Path,
    proto: bytes,
    arch: str = "llama",
    add_space_prefix: bool | None = None,
    chat_template: str | None = None,
    tokenizer_model: str = "llama",
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    """A loadable GGUF model: the vocabulary's tokenizer metadata as llama.cpp writes it for a llama-architecture
    model (`add_space_prefix` only when given, as the Gemma converters do) and tiny random weights.
    `tokenizer_model` other than "llama" makes a file whose tokenizer kind is unknown (for error tests)."""
    tokens, scores, types = spm_vocab(proto)
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    head_dim = hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:  # [out, in] like the HF weights; the writer reverses to ggml's order
        return (rng.standard_normal(shape) * 0.5 / np.sqrt(shape[-1])).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(len(tokens), hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
