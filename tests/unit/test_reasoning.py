"""Reasoning parsers (qwen3, deepseek_r1): thinking and answer of whole outputs, with the template's prompt opening
or closing the block, and streaming the same text cut anywhere (inside the tags too) giving exactly the same split,
never sending part of a tag."""

from __future__ import annotations

import random

import pytest

from netra_jax.serving.reasoning import REASONING_PARSERS, get_reasoning_parser

OPEN = "<|im_start|>assistant\n<think>\n"  # a template that starts the thinking itself (Qwen3 thinking-2507, R1)
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False
PLAIN = "<|im_start|>assistant\n"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("qwen3", PLAIN, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("qwen3", PLAIN, "It is 4, no thinking.", None, "It is 4, no thinking."),
    ("qwen3", PLAIN, "It is 4 </think> as text", None, "It is 4 </think> as text"),
    ("qwen3", PLAIN, "\n<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", PLAIN, "<think></think>answer", None, "answer"),
    ("qwen3", PLAIN, "<thin", None, "<thin"),
    ("qwen3", OPEN, "thinking first</think>answer", "thinking first", "answer"),
    ("qwen3", OPEN, "<think>repeated tag</think>answer", "repeated tag", "answer"),
    (
        "qwen3",
        CLOSED,
        "Just the answer, with a literal <think> in it.",
        None,
        "Just the answer, with a literal <think> in it.",
    ),
    ("deepseek_r1", PLAIN, "<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "\n\nYes."),
    ("deepseek_r1", PLAIN, "no start tag</think>Yes.", "no start tag", "Yes."),
    ("deepseek_r1", PLAIN, "never closed", "never closed", None),
    ("deepseek_r1", OPEN, "a < b </thi</think>ok", "a < b </thi", "ok"),
    ("deepseek_r1", CLOSED, "answer only", None, "answer only"),
]


def streamed(parser, text: str, cuts: list[int]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    pieces, prev = [], 0
    for c in [*cuts, len(text)]:
        pieces.append(parser.feed(text[prev:c]))
        prev = c
    pieces.append(parser.finish())
    reasoning = "".join(r for r, _ in pieces) or None
    content = "".join(c for _, c in pieces) or None
    return reasoning, content, pieces


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_whole_output(name, prompt, text, reasoning, content):
    assert get_reasoning_parser(name)(prompt).extract(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_streaming_equals_whole(name, prompt, text, reasoning, content):
    cls = get_reasoning_parser(name)
    rng = random.Random(len(text))
    cuts = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    cuts += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) for _ in range(20)]
    for cut in cuts:
        r, c, pieces = streamed(cls(prompt), text, cut)
        assert (r, c) == (reasoning, content), cut
        if "<" not in (content or "") + (reasoning or ""):  # tags are consumed whole, never sent in part
            assert not any("<" in r + c for r, c in pieces)


def test_registry():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("granite")
