"""Bad input against a real server (a table plus hypothesis-generated requests): each gets a bounded 4xx envelope,
leaves the engine untouched (steps, admissions, KV blocks, pool invariant) and is followed by a served request."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_harness import ENVELOPE_KEYS, MAX_BODY, main_server, record, release_main_server, sse_events, wait_idle
from test_server import BAD

from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest

C, CC = "/v1/completions", "/v1/chat/completions"
MAX_ERROR_BYTES = 2048  # an error answer never echoes a large input back
VOCAB = 512
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
    ("tool message", CC, {"messages": [{"role": "tool", "content": "x"}]}, {}, 400, "messages.0.role"),
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
            before = _engine_state(wait_idle(server))
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = http.request(method, path, headers=headers, **kw)
            stats["cases"] += 1
            stats["5xx"] += r.status_code >= 500
            assert r.status_code == status, f"{name}: {r.status_code} {r.text[:500]}"
            err = _bounded_envelope(r, name)
            assert param == "*" or err["param"] == param, f"{name}: {err}"
            assert _engine_state(wait_idle(server)) == before, name
            good = http.post(C, json=ok_body)
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1, name
    record("bad-input table cases", stats["cases"])
    record("bad-input table 5xx", stats["5xx"])
    assert stats["cases"] >= 40 and stats["5xx"] == 0


def test_oversized_bodies(server):
    """Over --max-body-bytes: 413 whether Content-Length announces it or the body is chunked; engine untouched."""
    before = _engine_state(wait_idle(server))
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
        assert _engine_state(wait_idle(server)) == before
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
def _strategy(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """A strategy for JSON values of a pydantic JSON schema, with edge values mixed in (huge and negative ints,
    huge floats, odd strings)."""
    if "$ref" in schema:
        return _strategy(defs[schema["$ref"].split("/")[-1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([_strategy(s, defs, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "integer":
        return st.one_of(st.integers(-3, 8), st.integers(), st.sampled_from([VOCAB, 2**31, 2**63, -(2**63)]))
    if t == "number":
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.integers(-3, 3))
    if t == "string":
        return st.one_of(st.text(max_size=12), st.sampled_from(["", "\x00", "é中😀", "{{ 7 * 7 }}", "a" * 300]))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        item = _strategy(schema.get("items", {"type": "integer"}), defs, depth + 1)
        return st.lists(item, min_size=schema.get("minItems", 0), max_size=4 if depth else 6)
    if t == "object":
        props = schema.get("properties")
        if props:
            return st.fixed_dictionaries({}, optional={k: _strategy(v, defs, depth + 1) for k, v in props.items()})
        values = schema.get("additionalProperties")
        vs = _strategy(values, defs, depth + 1) if isinstance(values, dict) else st.integers(-5, 5)
        keys = st.one_of(st.integers(-2, VOCAB + 2).map(str), st.text(max_size=4))
        return st.dictionaries(keys, vs, max_size=3)
    return st.one_of(st.none(), st.integers(), st.text(max_size=5))


def _request_strategy(model: type) -> st.SearchStrategy:
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    props = {k: v for k, v in schema["properties"].items() if k != "response_format"}  # own suite: structured output
    small = st.one_of(st.integers(-1, 4), st.sampled_from([0, 10**30, 2**63]))
    bounded = {"max_tokens": small, "max_completion_tokens": small, "n": st.integers(-1, 3) | st.just(10**9)}
    opt = {k: bounded[k] if k in bounded else _strategy(v, defs) for k, v in props.items()}
    required = {"max_tokens": st.integers(-1, 4)}  # never "the rest of the context": keeps valid requests short
    if model is CompletionRequest:
        tokens = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3)), max_size=6)
        required["prompt"] = st.one_of(
            st.text(max_size=20), tokens, st.lists(tokens, max_size=3), st.lists(st.text(max_size=8), max_size=3)
        )
    else:
        msg = st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]),
                "content": st.one_of(st.text(max_size=20), st.none()),
            }
        )
        required["messages"] = st.lists(msg, max_size=3)
    opt = {k: v for k, v in opt.items() if k not in required}
    extra = st.fixed_dictionaries({}, optional={"unknown_field": st.integers(), "chat_template": st.just("{{ 1 }}")})
    many = st.tuples(st.fixed_dictionaries(required, optional=opt), extra).map(lambda t: {**t[0], **t[1]})
    # a few fields at a time: more of these requests are valid, so generation runs too
    few = st.lists(st.sampled_from(sorted(opt)), max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(required, optional={k: opt[k] for k in keys})
    )
    return st.one_of(many, few)


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
        @given(body=_request_strategy(model))
        def run(body):
            _check_generated(http, path, body, tally)

        run()
        wait_idle(server)
        assert http.post(C, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    record(f"generated requests to {path}", tally)
    assert tally["5xx"] == 0 and tally["2xx"] > 0 and tally["4xx"] > 0
