"""Bad input against a real server (a table plus hypothesis-generated requests): each gets a bounded 4xx envelope,
leaves the engine untouched (steps, admissions, KV blocks, pool invariant) and is followed by a served request. The
table covers issue 14's request fields too (tools, tool_choice, tool-call history, reasoning_effort,
chat_template_kwargs, continue_final_message, echo on chat, structured_outputs / guided_*, priority, request_id,
truncate_prompt_tokens, prompt_logprobs): each refusal names its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from reliability_harness import ENVELOPE_KEYS, MAX_BODY, main_server, record, release_main_server
from request_strategies import VOCAB, request_bodies
from support.bad_requests import BAD
from support.server import engine_idle, sse_events

from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest

C, CC = "/v1/completions", "/v1/chat/completions"
MAX_ERROR_BYTES = 2048  # an error answer never echoes a large input back
MSG = [{"role": "user", "content": "hi"}]
HUGE = "k" * 100_000
JSON = {"Content-Type": "application/json"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# (name, path, body: dict | bytes, headers, status, param); param "*" = not checked
TABLE: list[tuple[str, str, object, dict, int, str | None]] = [
    ("truncated JSON", C, b'{"prompt": "hi",', JSON, 400, None),
    ("empty body", C, b"", JSON, 400, None),
    (
        "form-encoded body",
        C,
        b"prompt=hi&max_tokens=2",
        {"Content-Type": "application/x-www-form-urlencoded"},
        400,
        None,
    ),
    (
        "multipart body",
        C,
        b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--b--\r\n',
        {"Content-Type": "multipart/form-data; boundary=b"},
        400,
        None,
    ),
    ("body is a string", C, b'"hi"', JSON, 400, None),
    ("body is a number", C, b"42", JSON, 400, None),
    ("body is null", C, b"null", JSON, 400, None),
    ("body is an empty list", CC, b"[]", JSON, 400, None),
    ("unknown top-level field", C, {"prompt": "hi", "foo": 1}, {}, 400, "foo"),
    ("100k-character unknown field", C, {"prompt": "hi", HUGE: 1}, {}, 400, "*"),
    (
        "unknown field in stream_options",
        C,
        {"prompt": "hi", "stream": True, "stream_options": {"x": 1}},
        {},
        400,
        "stream_options.x",
    ),
    (
        "chat_template_kwargs setting a reserved variable",
        CC,
        {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        {},
        400,
        "chat_template_kwargs.chat_template",
    ),
    ("temperature < 0", C, {"prompt": "hi", "temperature": -0.1}, {}, 400, "temperature"),
    ("temperature NaN", C, b'{"prompt": "hi", "temperature": NaN}', JSON, 400, "temperature"),
    ("temperature Infinity", C, b'{"prompt": "hi", "temperature": Infinity}', JSON, 400, "temperature"),
    ("temperature 1e400", C, b'{"prompt": "hi", "temperature": 1e400}', JSON, 400, "temperature"),
    ("top_p > 1", C, {"prompt": "hi", "top_p": 1.5}, {}, 400, "top_p"),
    ("top_k fractional", C, {"prompt": "hi", "top_k": 1.5}, {}, 400, "top_k"),
    ("min_p < 0", C, {"prompt": "hi", "min_p": -0.1}, {}, 400, "min_p"),
    ("repetition_penalty < 0", C, {"prompt": "hi", "repetition_penalty": -1}, {}, 400, "repetition_penalty"),
    ("frequency_penalty > 2", C, {"prompt": "hi", "frequency_penalty": 2.5}, {}, 400, "frequency_penalty"),
    ("presence_penalty < -2", CC, {"messages": MSG, "presence_penalty": -3}, {}, 400, "presence_penalty"),
    ("seed fractional", C, {"prompt": "hi", "seed": 1.5}, {}, 400, "seed"),
    ("max_tokens < 0", C, {"prompt": "hi", "max_tokens": -1}, {}, 400, "max_tokens"),
    ("max_tokens 1e30", C, {"prompt": "hi", "max_tokens": 10**30}, {}, 400, "max_tokens"),
    ("min_tokens < 0", C, {"prompt": "hi", "min_tokens": -1}, {}, 400, "min_tokens"),
    ("n over the cap", C, {"prompt": "hi", "n": 129, "max_tokens": 1}, {}, 400, "n"),
    ("n 1e30", CC, {"messages": MSG, "n": 10**30}, {}, 400, "n"),
    ("top_logprobs over the cap", CC, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, {}, 400, "top_logprobs"),
    ("17 stop strings", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, {}, 400, "*"),
    ("257 prompts", C, {"prompt": ["a"] * 257, "max_tokens": 1}, {}, 400, "prompt"),
    ("empty token list in a batch", C, {"prompt": [[1, 2], []]}, {}, 400, "prompt"),
    (
        "empty messages content parts",
        CC,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {},
        400,
        "messages.0.content",
    ),
    ("token id == vocab", C, {"prompt": [1, VOCAB]}, {}, 400, "prompt"),
    ("token id 2**63", C, {"prompt": [2**63]}, {}, 400, "prompt"),
    ("token id 1e30 in a batch", C, {"prompt": [[1], [10**30]]}, {}, 400, "prompt"),
    ("detokenize negative id", "/detokenize", {"tokens": [-5]}, {}, 400, "tokens"),
    ("logit_bias non-integer key", C, {"prompt": "hi", "logit_bias": {"abc": 1}}, {}, 400, "logit_bias"),
    ("logit_bias negative key", C, {"prompt": "hi", "logit_bias": {"-1": 1}}, {}, 400, "logit_bias"),
    ("logit_bias key == vocab", C, {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, {}, 400, "logit_bias"),
    ("logit_bias value NaN", C, b'{"prompt": "hi", "logit_bias": {"1": NaN}}', JSON, 400, "logit_bias"),
    ("logit_bias value string", C, {"prompt": "hi", "logit_bias": {"1": "x"}}, {}, 400, "logit_bias.1"),
    ("logit_bias 100k-character key", C, {"prompt": "hi", "logit_bias": {HUGE: 1}}, {}, 400, "logit_bias"),
    ("stop_token_ids negative", C, {"prompt": "hi", "stop_token_ids": [-1]}, {}, 400, "stop_token_ids"),
    ("stop_token_ids == vocab", CC, {"messages": MSG, "stop_token_ids": [VOCAB]}, {}, 400, "stop_token_ids"),
    ("stop_token_ids strings", C, {"prompt": "hi", "stop_token_ids": ["a"]}, {}, 400, "stop_token_ids.0"),
    ("text prompt longer than the context", C, {"prompt": "hello world " * 2000}, {}, 400, "prompt"),
    (
        "chat longer than the context",
        CC,
        {"messages": [{"role": "user", "content": "hey " * 2000}]},
        {},
        400,
        "messages",
    ),
    ("prompt + max_tokens over the context", C, {"prompt": [7] * 500, "max_tokens": 20}, {}, 400, "max_tokens"),
    (
        "prompt + max_completion_tokens over the context",
        CC,
        {"messages": MSG, "max_completion_tokens": 600},
        {},
        400,
        "max_completion_tokens",
    ),
    ("100k-character model name", C, {"prompt": "hi", "model": HUGE}, {}, 404, "model"),
    ("100k nested lists as the body", C, nested(100_000), JSON, 400, None),
    ("100k nested lists as the prompt", C, b'{"prompt": ' + nested(100_000) + b"}", JSON, 400, None),
    (
        "100k nested objects in metadata",
        C,
        b'{"prompt": "hi", "metadata": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
        JSON,
        400,
        None,
    ),
    ("non-UTF-8 bytes in a string", C, b'{"prompt": "\xff\xfe\xfa"}', JSON, 400, None),
    ("UTF-16 encoded body", CC, json.dumps({"messages": MSG}).encode("utf-16"), JSON, 400, None),
    ("lone surrogate escape", C, b'{"prompt": "\\ud800"}', JSON, 400, None),
]


def _chat(**fields) -> dict:
    return {"messages": MSG, **fields}


def _history(*turns: dict) -> dict:
    return {"messages": [*MSG, *turns]}


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


def _call(**call) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", **call}]}


TOOL = _tool(parameters={"type": "object", "properties": {"a": {"type": "integer"}}})
CALLED = _call(function={"name": "f", "arguments": '{"a": 1}'})  # an assistant turn a tool message answers
# Issue 14's request fields: (name, path, body, status, param); each refused by name, the engine untouched
NEW_FIELDS: list[tuple[str, str, dict, int, str]] = [
    ("tools not an array", CC, _chat(tools=TOOL), 400, "tools"),
    ("tools empty", CC, _chat(tools=[]), 400, "tools"),
    ("tool without function", CC, _chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    ("tool of another type", CC, _chat(tools=[{**TOOL, "type": "code_interpreter"}]), 400, "tools.0.type"),
    ("tool name with a space", CC, _chat(tools=[_tool(name="a b")]), 400, "tools.0.function.name"),
    ("tool name of 65 characters", CC, _chat(tools=[_tool(name="a" * 65)]), 400, "tools.0.function.name"),
    ("tool parameters a list", CC, _chat(tools=[_tool(parameters=[1])]), 400, "tools.0.function.parameters"),
    ("unknown key in a tool", CC, _chat(tools=[{**TOOL, "x": 1}]), 400, "tools.0.x"),
    (
        "tool schema that cannot be enforced",
        CC,
        _chat(tools=[_tool(parameters={"type": "nonsense"})], tool_choice="required"),
        400,
        "tools",
    ),
    ("tool_choice unknown string", CC, _chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    ("tool_choice a number", CC, _chat(tools=[TOOL], tool_choice=1), 400, "tool_choice"),
    (
        "tool_choice naming no tool",
        CC,
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice.function.name",
    ),
    ("tool_choice required without tools", CC, _chat(tool_choice="required"), 400, "tool_choice"),
    (
        "tool_choice auto without --enable-auto-tool-choice",
        CC,
        _chat(tools=[TOOL], tool_choice="auto"),
        400,
        "tool_choice",
    ),
    ("parallel_tool_calls a string", CC, _chat(tools=[TOOL], parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    (
        "tool_calls on a user message",
        CC,
        {"messages": [{**MSG[0], **_call(function={"name": "f", "arguments": "{}"}), "role": "user"}]},
        400,
        "messages.0.tool_calls",
    ),
    (
        "tool_calls arguments not JSON",
        CC,
        _history(_call(function={"name": "f", "arguments": "{not json"})),
        400,
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "tool_calls arguments a JSON list",
        CC,
        _history(_call(function={"name": "f", "arguments": "[1]"})),
        400,
        "messages.1.tool_calls.0.function.arguments",
    ),
    ("tool_calls without function", CC, _history(_call()), 400, "messages.1.tool_calls.0.function"),
    (
        "tool_calls an object",
        CC,
        _history({"role": "assistant", "tool_calls": {"id": "c1"}}),
        400,
        "messages.1.tool_calls",
    ),
    (
        "tool message without content",
        CC,
        _history(CALLED, {"role": "tool", "tool_call_id": "c1"}),
        400,
        "messages.2.content",
    ),
    (
        "tool_call_id a number",
        CC,
        _history(CALLED, {"role": "tool", "tool_call_id": 5, "content": "x"}),
        400,
        "messages.2.tool_call_id",
    ),
    ("reasoning_effort unknown", CC, _chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    ("reasoning_effort a number", CC, _chat(reasoning_effort=3), 400, "reasoning_effort"),
    ("chat_template_kwargs a list", CC, _chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat_template_kwargs a string", CC, _chat(chat_template_kwargs="x"), 400, "chat_template_kwargs"),
    *[
        (
            f"chat_template_kwargs setting {key}",
            CC,
            _chat(chat_template_kwargs={key: 1}),
            400,
            f"chat_template_kwargs.{key}",
        )
        for key in ("messages", "tools", "add_generation_prompt", "continue_final_message", "template", "limits")
    ],
    (
        "continue_final_message after a user message",
        CC,
        _chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    (
        "continue_final_message with add_generation_prompt",
        CC,
        {
            **_history({"role": "assistant", "content": "a"}),
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        400,
        "add_generation_prompt",
    ),
    ("continue_final_message a string", CC, _chat(continue_final_message="yes"), 400, "continue_final_message"),
    ("echo on chat a string", CC, _chat(echo="yes"), 400, "echo"),
    (
        "structured_outputs two at once",
        C,
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    ("structured_outputs empty", C, {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
    (
        "structured_outputs unknown key",
        C,
        {"prompt": "hi", "structured_outputs": {"regexp": "a"}},
        400,
        "structured_outputs.regexp",
    ),
    (
        "structured_outputs bad regex",
        C,
        {"prompt": "hi", "structured_outputs": {"regex": "(("}},
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs bad schema",
        CC,
        _chat(structured_outputs={"json": {"type": "nonsense"}}),
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs schema not JSON",
        C,
        {"prompt": "hi", "structured_outputs": {"json": "{"}},
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs bad grammar",
        C,
        {"prompt": "hi", "structured_outputs": {"grammar": "start: ("}},
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs empty choice",
        C,
        {"prompt": "hi", "structured_outputs": {"choice": []}},
        400,
        "structured_outputs",
    ),
    (
        "guided_regex and guided_json",
        C,
        {"prompt": "hi", "guided_regex": "a", "guided_json": {"type": "object"}},
        400,
        "guided_regex",
    ),
    (
        "guided_choice and response_format",
        CC,
        _chat(guided_choice=["a"], response_format={"type": "json_object"}),
        400,
        "guided_choice",
    ),
    ("guided_regex bad", C, {"prompt": "hi", "guided_regex": "[z-a]"}, 400, "guided_regex"),
    ("guided_json bad schema", CC, _chat(guided_json={"type": "nonsense"}), 400, "guided_json"),
    ("guided_json not JSON", C, {"prompt": "hi", "guided_json": "{"}, 400, "guided_json"),
    ("guided_choice empty", C, {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("guided_choice a string", C, {"prompt": "hi", "guided_choice": "a"}, 400, "guided_choice"),
    ("guided_grammar bad", C, {"prompt": "hi", "guided_grammar": "start: ("}, 400, "guided_grammar"),
    ("priority a string", C, {"prompt": "hi", "priority": "high"}, 400, "priority"),
    ("priority fractional", C, {"prompt": "hi", "priority": 1.5}, 400, "priority"),
    ("priority under fcfs", CC, _chat(priority=-5), 400, "priority"),
    ("priority 1e30 under fcfs", C, {"prompt": "hi", "priority": 10**30}, 400, "priority"),
    ("request_id a number", C, {"prompt": "hi", "request_id": 5}, 400, "request_id"),
    ("truncate_prompt_tokens 0", C, {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens -2", C, {"prompt": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    (
        "truncate_prompt_tokens 1e30",
        C,
        {"prompt": "hi", "truncate_prompt_tokens": 10**30},
        400,
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens over the context",
        CC,
        _chat(truncate_prompt_tokens=100_000),
        400,
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens a string",
        C,
        {"prompt": "hi", "truncate_prompt_tokens": "5"},
        400,
        "truncate_prompt_tokens",
    ),
    ("prompt_logprobs -2", C, {"prompt": "hi", "prompt_logprobs": -2}, 400, "prompt_logprobs"),
    ("prompt_logprobs -1", C, {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt_logprobs 21", C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs 1e30", CC, _chat(prompt_logprobs=10**30), 400, "prompt_logprobs"),
    ("prompt_logprobs with stream", C, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("prompt_logprobs a boolean", C, {"prompt": "hi", "prompt_logprobs": True}, 400, "prompt_logprobs"),
]
TABLE += [(name, path, body, {}, status, param) for name, path, body, status, param in NEW_FIELDS]

BASE = [(f"{m} {p} {b!r}"[:60], m, p, b, s, prm) for m, p, b, s, prm in BAD]


@pytest.fixture(scope="module")
def server(request):
    yield main_server()
    release_main_server(request)


def _bounded_envelope(r: httpx.Response, case: str) -> dict:
    assert len(r.content) <= MAX_ERROR_BYTES, f"{case}: {len(r.content)}-byte error answer"
    err = r.json()["error"]
    assert set(err) == ENVELOPE_KEYS and err["message"] and err["type"], f"{case}: {err}"
    return err


def _engine_state(d: dict) -> tuple:
    return d["steps"], d["requests_admitted"], d["blocks"], d["invariant"]


def test_bad_input_matrix(server):
    """Every case: its 4xx and envelope, the engine untouched, then a valid request served."""
    stats = {"cases": 0, "5xx": 0}
    ok_body = {"prompt": [1, 2, 3], "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        cases = [
            (name, "POST", path, body, headers, status, param) for name, path, body, headers, status, param in TABLE
        ] + [(name, m, p, b, {}, s, prm) for name, m, p, b, s, prm in BASE]
        for name, method, path, body, headers, status, param in cases:
            before = _engine_state(engine_idle(server))
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = http.request(method, path, headers=headers, **kw)
            stats["cases"] += 1
            stats["5xx"] += r.status_code >= 500
            assert r.status_code == status, f"{name}: {r.status_code} {r.text[:500]}"
            err = _bounded_envelope(r, name)
            assert param == "*" or err["param"] == param, f"{name}: {err}"
            assert _engine_state(engine_idle(server)) == before, name
            good = http.post(C, json=ok_body)
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1, name
    record("bad-input table cases", stats["cases"])
    record("bad-input table 5xx", stats["5xx"])
    assert stats["cases"] >= 40 and stats["5xx"] == 0


def test_oversized_bodies(server):
    """Over --max-body-bytes: 413 whether Content-Length announces it or the body is chunked; engine untouched."""
    before = _engine_state(engine_idle(server))
    big = json.dumps({"prompt": "x" * (MAX_BODY + 1000)}).encode()

    step = 64 << 10

    def chunks():
        for i in range(0, len(big), step):
            yield big[i : i + step]

    with httpx.Client(base_url=server.url, timeout=60) as http:
        for kw in ({"content": big, "headers": JSON}, {"content": chunks(), "headers": JSON}):
            r = http.post(C, **kw)
            assert r.status_code == 413, r.text[:300]
            assert _bounded_envelope(r, "oversized")["code"] == "request_too_large"
        assert _engine_state(engine_idle(server)) == before
        assert http.post(C, json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_documented_lenient_cases(server):
    """Policies that accept: any Content-Type carrying a JSON object, informational OpenAI fields, and unknown keys
    inside chat messages (a previous answer's message can be sent back as it is)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(C, content=json.dumps({"prompt": "hi", "max_tokens": 1}), headers={"Content-Type": "text/plain"})
        assert r.status_code == 200
        r = http.post(C, json={"prompt": "hi", "max_tokens": 1, "user": "u", "store": False, "metadata": {"k": "v"}})
        assert r.status_code == 200
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "refusal": None, "annotations": []},
        ]
        assert http.post(CC, json={"messages": msgs, "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------------------------------------- hypothesis
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check_generated(http: httpx.Client, path: str, body: dict, tally: dict[str, int]) -> None:
    if body.get("max_completion_tokens") is None:
        body.pop("max_completion_tokens", None)  # None would mean max_tokens; keep the bounded max_tokens then
    if body.get("stream") is True:
        with http.stream("POST", path, json=body) as r:
            lines = list(r.iter_lines())
        status = r.status_code
        if status == 200:
            events = sse_events(lines)
            assert events and events[-1] == "[DONE]", lines[-3:]
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert not errors, errors
        text = "\n".join(lines)
    else:
        r = http.post(path, json=body)
        status, text = r.status_code, r.text
    tally["examples"] += 1
    tally[f"{status // 100}xx"] = tally.get(f"{status // 100}xx", 0) + 1
    assert status < 500, f"{body!r}: {status} {text[:500]}"
    if status >= 400:
        assert len(text.encode()) <= MAX_ERROR_BYTES, f"{body!r}: {len(text)}-byte error"
        assert set(json.loads(text)["error"]) == ENVELOPE_KEYS
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("model, path", [(CompletionRequest, C), (ChatCompletionRequest, CC)])
def test_generated_requests(server, model, path):
    tally = {"examples": 0, "2xx": 0, "4xx": 0, "5xx": 0}
    with httpx.Client(base_url=server.url, timeout=120) as http:

        @SETTINGS
        @given(body=request_bodies(model))
        def run(body):
            _check_generated(http, path, body, tally)

        run()
        engine_idle(server)
        assert http.post(C, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    record(f"generated requests to {path}", tally)
    assert tally["5xx"] == 0 and tally["2xx"] > 0 and tally["4xx"] > 0


WEIRD_REQUEST_IDS = ["", "a/b c\n\t\x00", "é中😀", "../../etc/passwd", "%s%n{}", "r" * 10_000]


def test_weird_request_ids(server):
    """vLLM's request_id takes any string: each is served with the response id built from it (completions, chat,
    streamed chat; an empty one gets a random id, as in vLLM), concurrent requests reusing one id are all served, and
    no KV block is left behind."""

    def named(prefix: str, rid: str, got: str) -> bool:
        return got == f"{prefix}-{rid}" if rid else re.fullmatch(rf"{prefix}-[0-9a-f]{{32}}", got) is not None

    with httpx.Client(base_url=server.url, timeout=60) as http:
        for rid in WEIRD_REQUEST_IDS:
            r = http.post(C, json={"prompt": "hi", "max_tokens": 2, "request_id": rid})
            assert r.status_code == 200 and named("cmpl", rid, r.json()["id"]), r.text[:300]
            r = http.post(CC, json={**_chat(max_tokens=2), "request_id": rid})
            assert r.status_code == 200 and named("chatcmpl", rid, r.json()["id"]), r.text[:300]
            with http.stream("POST", CC, json={**_chat(max_tokens=2), "request_id": rid, "stream": True}) as r:
                events = sse_events(list(r.iter_lines()))
            assert r.status_code == 200 and events[-1] == "[DONE]"
            (got,) = {e["id"] for e in events if isinstance(e, dict)}
            assert named("chatcmpl", rid, got)

        def same_id(i: int) -> httpx.Response:
            body = {"prompt": f"hi {i}", "max_tokens": 4, "ignore_eos": True, "request_id": "shared"}
            return http.post(C, json=body)

        with ThreadPoolExecutor(6) as ex:
            answers = list(ex.map(same_id, range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
    engine_idle(server)
