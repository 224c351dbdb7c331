"""Tokenizer, chat templates and incremental detokenizer against the reference fixtures.
Covers Hugging Face directories, GGUF metadata (SmolLM2 and synthetic files), the sandbox and streaming."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from support.checkpoints import FIXTURES

from netra_jax.assets import default_model_path
from netra_jax.loader.gguf_loader import read_gguf_metadata
from netra_jax.tokenization.chat_template import (
    ChatTemplateError,
    ChatTemplateLimits,
    NoChatTemplateError,
    render_chat_template,
)
from netra_jax.tokenization.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from netra_jax.tokenization.tokenizer import Tokenizer

TINY_DIRS = sorted(p for p in FIXTURES.glob("tiny-*") if p.is_dir())
SMOLLM_CASES = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())["cases"]
MULTIBYTE = "Héllo wörld! 你好，世界。 Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 naïve café — «quotes» ∑∫ 日本語のテキスト"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "Hello there, who are you?"}]


def _reference(d: Path) -> dict:
    return json.loads((d / "reference.json").read_text())


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.load(FIXTURES / "tiny-llama")


def _write_tiny_gguf(path: Path, pre: str = "gpt2", model: str = "gpt2", add_bos: bool = False) -> Path:
    """A GGUF file holding only tiny-llama's tokenizer (no tensors)."""
    spec = json.loads((FIXTURES / "tiny-llama" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------------------- reference fixtures


@pytest.mark.parametrize("d", TINY_DIRS, ids=lambda d: d.name)
def test_tiny_fixture_chat_and_plain_encoding(d: Path) -> None:
    tok, ref = Tokenizer.load(d), _reference(d)
    chat = ref["chat"]
    assert tok.apply_chat_template(chat["messages"]) == chat["prompt_text"]
    assert tok.encode_chat(chat["messages"]) == chat["prompt_ids"]
    for case in ref["cases"]:
        assert tok.encode(case["text"]) == case["prompt_ids"]
        assert tok.decode(case["prompt_ids"]) == case["text"]
    assert tok.eos_token_ids == (2,) and tok.pad_token_id == 0 and tok.bos_token_id is None
    assert tok.all_special_ids == (0, 1, 2) and tok.vocab_size == 512
    assert tok.convert_ids_to_tokens([1, 2, 0]) == ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.mark.parametrize("case", SMOLLM_CASES, ids=lambda c: c["messages"][-1]["content"][:20])
def test_smollm2_gguf_matches_reference(smollm: Tokenizer, case: dict) -> None:
    assert smollm.apply_chat_template(case["messages"]) == case["prompt_text"]
    assert smollm.encode_chat(case["messages"]) == case["prompt_ids"]
    assert smollm.encode(case["prompt_text"], add_special_tokens=False) == case["prompt_ids"]
    assert smollm.decode(case["greedy_ids"]) == case["greedy_text"]


def test_smollm2_special_tokens(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    # the file's eos <|im_end|>, then <|endoftext|>, which llama.cpp also ends generation at by its text
    assert smollm.eos_token_ids == (2, 0) and smollm.bos_token_id == 1 and smollm.pad_token_id == 2
    assert smollm.id_to_token(1) == "<|im_start|>" and len(smollm.all_special_ids) == 17
    ids = smollm.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "user\nHi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert smollm.encode("Hello world! 123")[-3:] == [33, 34, 35]  # smollm pre-tokenizer splits digits
    assert smollm.decode(smollm.encode(MULTIBYTE)) == MULTIBYTE


# ------------------------------------------------------------------------------------------------------- GGUF


def test_metadata_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    path = _write_tiny_gguf(tmp_path / "t.gguf")
    ours = read_gguf_metadata(path)
    theirs = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    assert ours == theirs
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(tmp_path / "bad.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:500])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf_metadata(tmp_path / "cut.gguf")


def test_gguf_tokenizer_matches_hf_tokenizer(tmp_path: Path, tiny: Tokenizer) -> None:
    tok = Tokenizer.load(_write_tiny_gguf(tmp_path / "t.gguf"))
    ref = _reference(FIXTURES / "tiny-llama")
    for case in ref["cases"]:
        assert tok.encode(case["text"]) == tiny.encode(case["text"]) == case["prompt_ids"]
        assert tok.decode(case["prompt_ids"]) == case["text"]
    assert tok.encode_chat(ref["chat"]["messages"]) == ref["chat"]["prompt_ids"]
    assert tok.encode(MULTIBYTE) == tiny.encode(MULTIBYTE)
    # the file's eos <|im_end|>, then <|endoftext|>, which llama.cpp also ends generation at by its text
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2, 0), 0)
    with_bos = Tokenizer.load(_write_tiny_gguf(tmp_path / "b.gguf", add_bos=True))
    assert with_bos.encode("Hi") == [1, *tok.encode("Hi")]
    assert with_bos.encode("Hi", add_special_tokens=False) == tok.encode("Hi")


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt2", ["abc", "Ġ12345"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_gguf_pre_tokenizer_styles(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "t.gguf", pre=pre))
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("abc 12345")] == pieces


def test_gguf_unsupported_tokenizers_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "wpm.gguf", model="bert"))
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery"))
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing")


# ------------------------------------------------------------------------------------ Hugging Face directories


def _tiny_dir(tmp_path: Path, tokenizer_config: dict, generation_config: dict | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(FIXTURES / "tiny-llama" / "tokenizer.json", d)
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config))
    return d


def test_named_templates_eos_lists_and_token_dicts(tmp_path: Path) -> None:
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": "<|im_start|>",
        "chat_template": [
            {"name": "default", "template": "D{{ bos_token }}{{ eos_token }}{{ pad_token }}"},
            {"name": "tool_use", "template": "T{{ tools|tojson }}"},
        ],
    }
    tok = Tokenizer.load(_tiny_dir(tmp_path, config, {"eos_token_id": [0, 2]}))
    assert tok.eos_token_ids == (0, 2) and tok.bos_token_id == 1 and tok.pad_token_id is None
    assert tok.apply_chat_template(USER) == "D<|im_start|><|im_end|>"  # an unset pad_token renders empty
    tools = [{"type": "function", "function": {"name": "été"}}]
    assert tok.apply_chat_template(USER, tools=tools) == 'T[{"type": "function", "function": {"name": "été"}}]'
    assert tok.apply_chat_template(USER, chat_template="tool_use") == "Tnull"
    assert tok.apply_chat_template(USER, chat_template="X{{ messages|length }}") == "X1"


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.load(_tiny_dir(tmp_path, {"eos_token": "<|im_end|>"}))
    with pytest.raises(NoChatTemplateError, match="no chat template") as raised:
        tok.apply_chat_template(USER)
    assert str(raised.value).startswith(NoChatTemplateError.BASE) and "chat_template=" in str(raised.value)
    assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)  # as raised in a Ray worker
    assert tok.encode_chat(USER, chat_template=CHATML) == _reference(FIXTURES / "tiny-llama")["chat"]["prompt_ids"]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_bad_ids_and_text_raise(tiny: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.decode([5, 512])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.id_to_token(-1)
    with pytest.raises(TypeError, match="ints"):
        tiny.decode([1.5])
    with pytest.raises(TypeError, match="str"):
        tiny.encode(b"bytes")


# ------------------------------------------------------------------------------------------------ messages


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "list of dicts"),
        ([], "must not be empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"content'\]\[0\]"),
    ],
)
def test_bad_messages_raise_value_error(tiny: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny.apply_chat_template(messages)


def test_text_parts_are_joined_and_tool_calls_allowed(tiny: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert tiny.apply_chat_template(parts) == "<|im_start|>user\nHello\nthere<|im_end|>\n<|im_start|>assistant\n"
    calls = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert render_chat_template("{{ messages[1].tool_calls[0].id }}", calls) == "1"


# ------------------------------------------------------------------------------------- template environment


def test_template_environment_matches_transformers() -> None:
    out = render_chat_template(
        "{{ messages[0]|tojson(indent=2) }}|{{ 'é'|tojson }}|{% for i in range(5) %}{% if i == 2 %}{% break %}"
        "{% endif %}{{ i }}{% endfor %}|{% generation %}G{% endgeneration %}|{{ strftime_now('%Y')|length }}"
        "|{{ bos_token }}|{{ eos_token }}|{{ flag }}",
        USER,
        special_tokens={"bos_token": None, "eos_token": "</s>"},
        flag=True,
    )
    assert out == '{\n  "role": "user",\n  "content": "Hello there, who are you?"\n}|"é"|01|G|4||</s>|True'
    with pytest.raises(ChatTemplateError, match="rejected the conversation: roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", USER)
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render_chat_template("{% for m in messages %}", USER)


def test_continue_final_message(tiny: Tokenizer) -> None:
    msgs = [*USER, {"role": "assistant", "content": "I am"}]
    text = tiny.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nHello there, who are you?<|im_end|>\n<|im_start|>assistant\nI am"
    with pytest.raises(ValueError, match="cannot both be set"):
        tiny.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ messages.__class__ }}", "unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "unsafe"),
        ("{{ self.__init__.__globals__ }}", "unsafe"),
        ("{{ messages.append(1) }}", "unsafe"),
        ("{{ messages[0].update({'role': 'x'}) }}", "unsafe"),
        ("{{ 'a' * 1000000000 }}", "repetition exceeds"),
        ("{{ 7 ** 100000000 }}", "power is too large"),
        ("{{ 'x'|center(1000000000) }}", "number above"),
        ("{{ 'x'.ljust(1000000000) }}", "number above"),
        ("{{ '%099999999d' % 1 }}", "number above"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "over"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "exceeds"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
        ("{{ lipsum(100000) }}", "undefined"),
    ],
)
def test_sandbox_refuses_unsafe_or_unbounded_templates(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat_template(template, USER)


@pytest.mark.parametrize(
    "template",
    [
        "{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    ],
)
def test_render_time_is_bounded(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="did not finish within 0.2 s"):
        render_chat_template(template, USER, limits=ChatTemplateLimits(timeout_s=0.2))


def test_template_and_output_size_limits() -> None:
    limits = ChatTemplateLimits(max_template_chars=100, max_output_chars=1000)
    with pytest.raises(ChatTemplateError, match="above 100"):
        render_chat_template("x" * 101, USER, limits=limits)
    with pytest.raises(ChatTemplateError, match="output exceeds 1000"):
        render_chat_template("{% for i in range(1000) %}ab{% endfor %}", USER, limits=limits)
    assert len(render_chat_template("{% for i in range(400) %}ab{% endfor %}", USER, limits=limits)) == 800


# ------------------------------------------------------------------------------------------------- streaming


def _stream(tok: Tokenizer, ids: list[int], sizes: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, tok.encode("Say something:"), **kwargs)
    chunks, i = [], 0
    for n in sizes:
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.flush())
    assert detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("name", ["smollm", "tiny"])
def test_detokenizer_never_splits_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name)
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    one_by_one = _stream(tok, ids, [1] * len(ids))
    assert "".join(one_by_one) == MULTIBYTE
    assert not any("\ufffd" in c for c in one_by_one)
    assert sum(1 for c in one_by_one if c == "") > 0  # some characters did span several tokens
    rng = random.Random(0)
    sizes = [rng.randint(1, 4) for _ in range(len(ids))]
    chunks = _stream(tok, ids, sizes)
    assert "".join(chunks) == MULTIBYTE and not any("\ufffd" in c for c in chunks)


def test_detokenizer_special_tokens_and_invalid_bytes(smollm: Tokenizer) -> None:
    ids = smollm.encode("Paris 😀<|im_end|>")
    assert "".join(_stream(smollm, ids, [1] * len(ids))) == "Paris 😀"
    assert "".join(_stream(smollm, ids, [1] * len(ids), skip_special_tokens=False)) == "Paris 😀<|im_end|>"
    lead = smollm.token_to_id("ð")  # byte 0xF0: starts a 4-byte character that never completes
    chunks = _stream(smollm, [lead, lead], [1, 1])
    assert "".join(chunks) == smollm.decode([lead, lead]) == "\ufffd\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(smollm).push([10**6])


def test_detokenizer_decodes_a_bounded_window(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tiny.encode(MULTIBYTE) * 60
    lengths: list[int] = []
    original = Tokenizer.decode

    def spy(self: Tokenizer, token_ids, skip_special_tokens: bool = True) -> str:
        lengths.append(len(token_ids))
        return original(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    chunks = _stream(tiny, ids, [1] * len(ids))
    monkeypatch.undo()
    assert "".join(chunks) == tiny.decode(ids)
    assert max(lengths) <= PROMPT_CONTEXT_TOKENS + MAX_HELD_TOKENS + 1 < len(ids) // 10


def test_detokenizer_text_is_the_streamed_text_when_a_special_id_decodes(tmp_path: Path) -> None:
    """An id counted special by the model's files but a plain token of the vocabulary (here the pad id of
    generation_config.json) decodes to text: that text is streamed and is part of `text` (what stop strings see)."""
    tok = Tokenizer.load(_tiny_dir(tmp_path, {"eos_token": "<|im_end|>"}, {"pad_token_id": 300}))
    word = tok.decode([300])
    assert 300 in tok.all_special_ids and word
    ids = [*tok.encode("Paris"), 300, *tok.encode(" is")]
    chunks = _stream(tok, ids, [1] * len(ids))
    assert "".join(chunks) == tok.decode(ids) and word in "".join(chunks)
