"""Tool-call parsers (hermes, llama3_json, mistral) and the readers of tool_choice "required" / named output: each
whole answer gives the expected content and calls, and streaming the same text cut anywhere (inside tags, inside
JSON strings and escapes, one character at a time, at random) rebuilds exactly that, in OpenAI's chunk shape."""

from __future__ import annotations

import random
import re

import pytest

from netra_jax.serving.tool_choice import NamedToolOutput, RequiredToolOutput
from netra_jax.serving.tool_parsers import TOOL_PARSERS, assemble, get_tool_parser

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" } ] { [ text", "items": [1, {"b": [true, null]}], "u": "\\u00e9\\\\"}'

# (text, content, [(name, arguments text)])
HERMES = [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    (
        f'Let me check.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "search", "arguments": {NESTED}}}\n</tool_call>',
        "Let me check.",
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    ('<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>', None, [("late_name", '{"x": 1}')]),
    ('<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", "{}")]),
    ('<tool_call>{"name": "quoted", "arguments": "{\\"a\\": 2}"}</tool_call>', None, [("quoted", '{"a": 2}')]),
    (
        '<tool_call>{"name": "code", "arguments": {"src": "print(\'</tool_call>\')"}}</tool_call> done',
        " done",
        [("code", '{"src": "print(\'</tool_call>\')"}')],
    ),
    ("A plain answer: 1 < 2 and <tool is not a tag.", "A plain answer: 1 < 2 and <tool is not a tag.", []),
    ("Ends with a tag's start <tool_", "Ends with a tag's start <tool_", []),
    ("<tool_call>not json</tool_call> rest", "<tool_call>not json</tool_call> rest", []),
    (
        '<tool_call>{"name": null, "arguments": {}}</tool_call>',
        '<tool_call>{"name": null, "arguments": {}}</tool_call>',
        [],
    ),
    ('<tool_call>{"name": "cut", "arguments": {"a": 1', None, [("cut", '{"a": 1')]),  # max_tokens inside a call
    ('<tool_call>{"name": "early", "arguments": {"a": 1}</tool_call>', None, [("early", '{"a": 1}')]),
    ("trailing tag <tool_call>", "trailing tag <tool_call>", []),
    ("  \n", "  \n", []),
]
LLAMA3 = [
    (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (
        f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "search", "arguments": {NESTED}}}',
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    ('{"name": "f", "parameters": {}} and some words', "and some words", [("f", "{}")]),
    ('Hello! {"name": "x"} is not a call here.', 'Hello! {"name": "x"} is not a call here.', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("  <|python", "  <|python", []),
]
MISTRAL = [
    (
        f'Sure [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "search", "arguments": {NESTED}}}]',
        "Sure",
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]search{NESTED}",
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    ('[TOOL_CALLS]f[ARGS]{"a": {"b": 1', None, [("f", '{"a": {"b": 1')]),
    ("No [TOOL here", "No [TOOL here", []),
]
PARSERS = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL}
MARKERS = {"hermes": "<", "llama3_json": "<|", "mistral": "["}  # how each parser's tags begin
CASES = [(name, *case) for name, cases in PARSERS.items() for case in cases]


def stream(parser, text: str, cuts: list[int]) -> list:
    """Deltas of `text` fed in pieces ending at `cuts` (then finish); None deltas left out."""
    out, prev = [], 0
    for c in [*cuts, len(text)]:
        d = parser.feed(text[prev:c])
        prev = c
        if d is not None:
            out.append(d)
    d = parser.finish()
    return out + ([d] if d is not None else [])


def summary(content, calls) -> tuple:
    return content, [(c.function.name, c.function.arguments) for c in calls]


def splits(text: str, seed: int) -> list[list[int]]:
    """Every single cut, one character at a time, and random multi-cuts."""
    rng = random.Random(seed)
    out = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for _ in range(20):
        out.append(sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))))
    return out


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_answer(name, text, content, calls):
    assert summary(*get_tool_parser(name)().extract(text)) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streaming_rebuilds_the_whole_answer(name, text, content, calls):
    cls = get_tool_parser(name)
    for cuts in splits(text, seed=len(text)):
        deltas = stream(cls(), text, cuts)
        assert summary(*assemble(deltas)) == (content, calls), cuts


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_chunk_shape(name, text, content, calls):
    """One character at a time: a call opens with index, id, type and name (arguments ""), later pieces carry
    only arguments; indices count up from 0; content never carries a piece of a tag that was a tag."""
    cls = get_tool_parser(name)
    deltas = stream(cls(), text, list(range(1, len(text))))
    seen = []
    for d in deltas:
        for t in d.tool_calls or ():
            if t.index not in seen:
                assert t.index == len(seen) and t.type == "function" and t.id and t.function.name
                assert t.function.arguments in ("", None) or isinstance(t.function.arguments, str)
                seen.append(t.index)
            else:
                assert t.id is None and t.type is None and t.function.name is None and t.function.arguments
    assert len(seen) == len(calls)
    marker = MARKERS[name]
    if content is None or marker not in content:
        assert not any(marker in (d.content or "") for d in deltas)


def test_ids():
    (_, (a, b)) = get_tool_parser("hermes")().extract(HERMES[1][0])
    assert re.fullmatch(r"call_[0-9a-f]{24}", a.id) and a.id != b.id
    (_, (m, _)) = get_tool_parser("mistral")().extract(MISTRAL[1][0])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", m.id)  # mistral-common's rule for ids in the history


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        get_tool_parser("pythonic")


CONSTRAINED = [
    (lambda: NamedToolOutput("get_weather"), WEATHER, [("get_weather", WEATHER)]),
    (lambda: NamedToolOutput("nested"), " " + NESTED + " ", [("nested", NESTED)]),
    (RequiredToolOutput, f'[{{"name": "get_weather", "parameters": {WEATHER}}}]', [("get_weather", WEATHER)]),
    (
        RequiredToolOutput,
        f'[{{"name": "a", "parameters": {{}}}}, {{"parameters": {NESTED}, "name": "b"}}]',
        [("a", "{}"), ("b", NESTED)],
    ),
    (RequiredToolOutput, '[{"name": "cut", "parameters": {"x": ', [("cut", '{"x": ')]),
]


@pytest.mark.parametrize(("make", "text", "calls"), CONSTRAINED)
def test_constrained_tool_choice_output(make, text, calls):
    """The grammar-written output of a named function (its arguments object) or of "required" (a list of
    name / parameters objects) read into calls, whole and streamed."""
    assert summary(*make().extract(text)) == (None, calls)
    for cuts in splits(text, seed=7):
        assert summary(*assemble(stream(make(), text, cuts))) == (None, calls)
