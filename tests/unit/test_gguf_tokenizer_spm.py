"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model == "llama"`) against the `sentencepiece` package and
transformers' GGUF tokenizer, streaming detokenization, and a SentencePiece GGUF model generating through `LLM`."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from support.checkpoints import DATA
from support.spm_gguf import CONTROL_SYMBOLS, TEXTS, train_spm, write_spm_gguf

from netra_jax.tokenization.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from netra_jax.tokenization.gguf import tokenizer_from_gguf_metadata
from netra_jax.tokenization.gguf_spm import merges_from_scores
from netra_jax.tokenization.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

REFERENCE = json.loads((DATA / "spm-gguf" / "reference.json").read_text("utf-8"))
VOCABS = REFERENCE["vocabs"]  # name -> model type, add_dummy_prefix, arch, proto, transformers' ids and decoding
SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in (*CONTROL_SYMBOLS, "<s>", "</s>")) + ")")
REPLACEMENT = "\ufffd"


def _gguf(tmp_path: Path, name: str, proto: bytes, **kwargs) -> Path:
    v = VOCABS[name]
    space_prefix = None if v["add_dummy_prefix"] else False  # the Gemma converters write add_space_prefix = False
    return write_spm_gguf(tmp_path / f"{name}.gguf", proto, v["arch"], add_space_prefix=space_prefix, **kwargs)


def _llama_cpp_ids(sp, text: str) -> list[int]:
    """llama.cpp's rule on top of SentencePiece: BOS, special tokens matched whole, and every other span encoded by
    SentencePiece itself (which adds the dummy `▁` prefix to each span)."""
    ids = [sp.bos_id()]
    for part in SPECIAL.split(text):
        if part:
            ids += [sp.piece_to_id(part)] if SPECIAL.fullmatch(part) else sp.encode(part)
    return ids


@pytest.mark.parametrize("name", ["llama-bpe", "gemma3-bpe"])
def test_bpe_vocab_matches_sentencepiece(tmp_path: Path, name: str) -> None:
    v = VOCABS[name]
    proto = train_spm(v["model_type"], v["add_dummy_prefix"])
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tok = Tokenizer.load(_gguf(tmp_path, name, proto))
    assert tok.vocab_size == sp.vocab_size() and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, sp.piece_to_id("<|im_end|>"))  # </s>, then <|im_end|> by its text (llama.cpp)
    byte_fallback = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == _llama_cpp_ids(sp, text), text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        if not SPECIAL.search(text):
            assert tok.decode(ids) == sp.decode(ids) == text
        byte_fallback += any(sp.is_byte(i) for i in ids)
    assert byte_fallback >= 5  # newlines, emoji, rare CJK and symbols are spelled with <0xNN> tokens
    assert tok.decode(tok.encode("<|im_start|>user\nHi<|im_end|>"), skip_special_tokens=False).startswith("<s>")


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_matches_transformers_gguf_tokenizer(tmp_path: Path, name: str) -> None:
    """Identical ids and decoding, except where transformers' GGUF converter departs from SentencePiece and llama.cpp:
    it adds no second `▁` to text that starts with a space, and none to text after a special token."""
    v = VOCABS[name]
    tok = Tokenizer.load(_gguf(tmp_path, name, base64.b64decode(v["proto"])))
    differ = set()
    for text, ids, decoded in zip(REFERENCE["texts"], v["ids"], v["decoded"], strict=True):
        ours = tok.encode(text)
        if ours != ids:
            differ.add(text)
            continue
        assert tok.decode(ours) == decoded, text
    prefixed = v["add_dummy_prefix"]
    expected = {t for t in TEXTS if prefixed and (t.startswith(" ") or any(SPECIAL.split(t)[2::2]))}
    assert differ == expected
    assert len(TEXTS) - len(differ) >= 18


def test_unigram_vocab_merges_by_score_like_llama_cpp(tmp_path: Path) -> None:
    """A unigram model in a llama GGUF is tokenized by score-ordered merges (llama.cpp, transformers), not by
    SentencePiece's Viterbi search: the ids may differ from SentencePiece's, the text never does."""
    v = VOCABS["llama-unigram"]
    proto = train_spm(v["model_type"], v["add_dummy_prefix"])
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tok = Tokenizer.load(_gguf(tmp_path, "llama-unigram", proto))
    same = 0
    for text in TEXTS:
        ids = tok.encode(text)
        same += ids == _llama_cpp_ids(sp, text)
        if not SPECIAL.search(text):
            assert tok.decode(ids) == sp.decode(ids) == text
    assert 0 < same < len(TEXTS)


def test_bad_sentencepiece_metadata_raises() -> None:
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "b", "ab"]}
    with pytest.raises(ValueError, match="0 tokenizer.ggml.scores for 4 tokens"):
        tokenizer_from_gguf_metadata(meta, "x.gguf")
    with pytest.raises(ValueError, match="malformed BPE merge"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.merges": ["ab"]}, "x.gguf")
    with pytest.raises(ValueError, match="3 token types for 4 tokens"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.token_type": [2, 1, 1]}, "x.gguf")


def test_merges_follow_scores_then_lengths() -> None:
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    scores = [0.0, 0.0, 0.0, 0.0, -2.0, -1.0, -3.0, 0.0]
    types = [2, 1, 1, 1, 1, 1, 1, 6]
    assert merges_from_scores(tokens, scores, types) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def _continuation(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add to the prompt, decoded in one go (with its leading `▁`, which decoding `ids` alone drops)."""
    head, full = tok.decode(prompt), tok.decode(prompt + ids)
    assert full.startswith(head)
    return full[len(head) :]


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    chunks = [detok.push([i]) for i in ids] + [detok.flush()]
    assert detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("name", ["llama-bpe", "gemma3-bpe"])
def test_streaming_detokenization_has_no_replacement_characters(tmp_path: Path, name: str) -> None:
    tok = Tokenizer.load(_gguf(tmp_path, name, base64.b64decode(VOCABS[name]["proto"])))
    # prompts ending in byte-fallback tokens, so the detokenizer's context may open inside a character
    prompts = [tok.encode(p) for p in ("Say:", "Say 😀😀", "你好 👍🏽👍🏽")]
    assert any(tok.decode(p[-PROMPT_CONTEXT_TOKENS:]).startswith(REPLACEMENT) for p in prompts)
    prefix = " " if VOCABS[name]["add_dummy_prefix"] else ""
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for prompt in prompts:
            chunks = _stream(tok, prompt, ids)
            assert "".join(chunks) == _continuation(tok, prompt, ids), (text, prompt)
            assert not any(REPLACEMENT in c for c in chunks)
            if not SPECIAL.search(text) and text:
                assert "".join(chunks) == prefix + text
        assert "".join(_stream(tok, [], ids)) == tok.decode(ids)


def test_gguf_model_with_sentencepiece_vocab_generates(tmp_path: Path) -> None:
    """Tiny random llama weights with the SentencePiece vocabulary: the engine tokenizes prompts as llama.cpp does,
    and output forced to a text with multi-byte characters (a grammar over the vocabulary, so llguidance reads the
    SentencePiece tokenizer too) streams and decodes to exactly that text."""
    from netra_jax import LLM, SamplingParams
    from netra_jax.sampling_params import StructuredOutputsParams

    proto = base64.b64decode(VOCABS["llama-bpe"]["proto"])
    sp = spm.SentencePieceProcessor(model_proto=proto)
    llm = LLM(str(_gguf(tmp_path, "llama-bpe", proto)), warmup=False, max_num_batched_tokens=64, num_kv_pages=16)
    tok = llm.get_tokenizer()
    target = "Paris, 你好 😀 naïve 123"
    forced = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=[target]))
    prompts = ["The capital of France is", " two  spaces\n😀"]
    outs = llm.generate(prompts, [forced, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == _llama_cpp_ids(sp, prompt)
    ids = list(outs[0].outputs[0].token_ids)
    assert outs[0].outputs[0].text == target == tok.decode(ids)
    assert len(outs[1].outputs[0].token_ids) == 5
    streamed = list(llm.stream(prompts[0], forced))
    deltas = [o.outputs[0].delta_text for o in streamed]
    assert "".join(deltas) == target and not any(REPLACEMENT in d for d in deltas)
    assert list(streamed[-1].outputs[0].token_ids) == ids
