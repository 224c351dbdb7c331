"""One OpenAI layer: the same request bodies sent to a real `netra-jax serve` process and run as a batch job
(`netra-jax batch` in this process, the same engine flags) get equal answers — chat, completions and Responses,
greedy, with logprobs, n > 1 with a seed, structured output, tools, vLLM extras — except ids and creation times
(random by design), and equal error
envelopes with the same status for the bodies the server refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from support.checkpoints import FIXTURES, REPO
from support.server import MODEL, SMALL, running_server

from netra_jax.cli import main as cli_main

TEMPLATE = REPO / "tests" / "fixtures" / "templates" / "qwen3_tools.jinja"  # renders tools: both must use it
FLAGS = (*SMALL, "--chat-template", str(TEMPLATE))
C, CC, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MSG = [{"role": "user", "content": "Tell me about the sea."}]
FLOAT_TOL = 1e-5  # logprobs of one request computed in the same step shapes; a tolerance for other platforms
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat greedy", CC, {"messages": MSG, "max_tokens": 8, "temperature": 0}),
    (
        "chat logprobs",
        CC,
        {"messages": MSG, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ),
    ("chat n=3 seeded", CC, {"messages": MSG, "max_tokens": 6, "n": 3, "seed": 11, "temperature": 1.0}),
    (
        "chat developer role, template kwargs, token ids",
        CC,
        {
            "messages": [{"role": "developer", "content": "Be brief."}, *MSG],
            "max_tokens": 5,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False},
            "return_token_ids": True,
        },
    ),
    (
        "chat json_schema",
        CC,
        {
            "messages": MSG,
            "max_tokens": 24,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                },
            },
        },
    ),
    (
        "chat named tool",
        CC,
        {
            "messages": MSG,
            "max_tokens": 24,
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    ("completion greedy logprobs", C, {"prompt": "The sea is", "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    (
        "completion two prompts n=2 seeded",
        C,
        {"prompt": ["one two", "three four"], "max_tokens": 5, "n": 2, "seed": 5, "temperature": 0.8},
    ),
    (
        "completion guided_choice, echo",
        C,
        {"prompt": "Yes or no?", "guided_choice": ["yes", "no"], "temperature": 0, "echo": True},
    ),
    ("completion token ids, stop", C, {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0, "stop": ["e"]}),
    (
        "responses instructions",
        R,
        {"input": "Tell me about the sea.", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0},
    ),
    ("responses previous_response_id", R, {"input": "hi", "previous_response_id": "resp_1"}),
    ("unknown field", C, {"prompt": "hi", "max_tokenz": 3}),
    ("bad temperature", CC, {"messages": MSG, "temperature": -1}),
    ("wrong type", C, {"prompt": "hi", "max_tokens": "3"}),
    ("unknown model", C, {"model": "gpt-4o", "prompt": "hi"}),
    ("too-long prompt", C, {"prompt": [5] * 600}),
    ("too-long chat", CC, {"messages": [{"role": "user", "content": "sea " * 700}]}),
    ("bad regex", C, {"prompt": "hi", "guided_regex": "(unclosed"}),
    ("two constraints", CC, {"messages": MSG, "guided_choice": ["a"], "guided_regex": "a"}),
    ("priority under fcfs", C, {"prompt": "hi", "priority": 3}),
]


@pytest.fixture(scope="module")
def server_answers() -> dict[str, tuple[int, dict]]:
    with running_server(*FLAGS) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        answers = {}
        for name, url, body in CASES:  # one at a time, as the batch job below runs them
            r = http.post(url, json=body)
            answers[name] = (r.status_code, r.json())
    return answers


@pytest.fixture(scope="module")
def batch_answers(tmp_path_factory) -> dict[str, tuple[int, dict]]:
    d = tmp_path_factory.mktemp("equal")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    lines = [json.dumps({"custom_id": name, "method": "POST", "url": url, "body": body}) for name, url, body in CASES]
    inp.write_text("\n".join(lines) + "\n")
    model = str(FIXTURES / MODEL)
    argv = ["batch", str(inp), str(out), "--model", model, *FLAGS, "--max-in-flight", "1", "--no-progress"]
    assert cli_main([*argv, "--no-warmup"]) == 0
    answers = {}
    for line in out.read_text().splitlines():
        o = json.loads(line)
        answers[o["custom_id"]] = (o["response"]["status_code"], o["response"]["body"])
    return answers


def _same(a: Any, b: Any, where: str = "") -> None:
    """Equal JSON values, floats within FLOAT_TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, int | float) and isinstance(b, int | float), (where, a, b)
        assert math.isclose(a, b, rel_tol=0, abs_tol=FLOAT_TOL), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_server_and_batch_answer_alike(name, server_answers, batch_answers):
    status, body = server_answers[name]
    batch_status, batch_body = batch_answers[name]
    assert batch_status == status, (status, body, batch_body)
    if status == 200 and body.get("object") == "response":
        for b in (body, batch_body):
            assert b.pop("id").startswith("resp_") and b.pop("created_at")
            for item in b["output"]:  # item ids are random too
                assert item.pop("id")
    elif status == 200:
        for b in (body, batch_body):
            assert b.pop("id") and b.pop("created")
            for choice in b["choices"]:  # tool-call ids are random too
                for call in choice.get("message", {}).get("tool_calls", []):
                    assert call.pop("id").startswith("call_")
    _same(body, batch_body)


def test_cases_cover_answers_and_refusals(server_answers):
    statuses = {name: status for name, (status, _) in server_answers.items()}
    assert sum(s == 200 for s in statuses.values()) == 11, statuses
    assert statuses["unknown model"] == 404
    assert {s for n, s in statuses.items() if s != 200 and n != "unknown model"} == {400}
    params = {name: answer["error"]["param"] for name, (status, answer) in server_answers.items() if status != 200}
    assert params == {
        "unknown field": "max_tokenz",
        "bad temperature": "temperature",
        "wrong type": "max_tokens",
        "unknown model": "model",
        "too-long prompt": "prompt",
        "too-long chat": "messages",
        "bad regex": "guided_regex",
        "two constraints": "guided_choice",
        "priority under fcfs": "priority",
        "responses previous_response_id": "previous_response_id",
    }
    greedy = server_answers["chat n=3 seeded"][1]
    assert len(greedy["choices"]) == 3
    assert server_answers["chat logprobs"][1]["choices"][0]["logprobs"]["content"][0]["bytes"]
