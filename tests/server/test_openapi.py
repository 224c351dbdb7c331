"""The served /openapi.json against a real `netra-jax serve` process: every `$ref` resolves under components/schemas,
every operation documents its answer and the error envelope; then a bounded schemathesis run over every operation
(positive and negative bodies) finds no 5xx, no answer outside its documented status, media type and schema."""

from __future__ import annotations

import collections
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.server import MODEL, SMALL, running_server

ERROR_STATUSES = ("400", "401", "404", "413", "429", "500", "503")
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
POSITIVE_EXAMPLES = 40
NEGATIVE_EXAMPLES = 20
HTTP_TIMEOUT_S = 60
# A valid value per field, for the half of positive cases made to pass the server's semantic checks (the schema
# alone admits empty prompts, token ids outside the vocabulary, temperatures of 1e300, ...).
VALID_INPUT = {
    "prompt": "hi",
    "messages": [{"role": "user", "content": "hi"}],
    "tokens": [1, 2, 3],
    "input": "hi",
}
RANGES = {
    "temperature": (0, 2),
    "top_p": (0.01, 1),
    "top_k": (-1, 50),
    "min_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
    "repetition_penalty": (0.01, 2),
    "logprobs": (0, 5),
    "top_logprobs": (0, 5),
    "prompt_logprobs": (0, 5),
    "max_tokens": (1, 4),
    "max_completion_tokens": (1, 4),
    "max_output_tokens": (1, 4),
    "n": (1, 2),
}
DROPPED = (  # free-form fields a generated value rarely makes valid (each has its own tests)
    "model",
    "stop_token_ids",
    "logit_bias",
    "stop",
    "min_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "continue_final_message",
    "suffix",
    "best_of",
    "priority",
    "text",
)


@pytest.fixture(scope="module")
def server():
    with running_server(*SMALL) as s:
        yield s


@pytest.fixture(scope="module")
def document(server) -> dict[str, Any]:
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["$ref"]] if "$ref" in value else []
        return own + [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


def test_every_ref_resolves_under_components(document):
    schemas = document["components"]["schemas"]
    refs = _refs(document)
    assert refs and all(r.startswith("#/components/schemas/") for r in refs), {r for r in refs if "$defs" in r}
    missing = {r for r in refs if r.rsplit("/", 1)[-1] not in schemas}
    assert not missing
    assert "$defs" not in str(document)


def test_operations_document_answers_and_errors(document):
    paths = document["paths"]
    for path, ops in paths.items():
        for method, op in ops.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            for status in ERROR_STATUSES:
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
            ok = responses["200"]["content"]
            assert ok and all(media["schema"] for media in ok.values()), (method, path, ok)
            if method == "post":  # bodies are parsed by the routes: documented by their doc(...)
                assert "requestBody" in op, f"{path}: no requestBody; openapi_extra=doc(Request, Response)"
                body = op["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].startswith("#/components/schemas/"), (method, path)
    for path, name, chunk in (
        ("/v1/completions", "CompletionResponse", "CompletionChunk"),
        ("/v1/chat/completions", "ChatCompletionResponse", "ChatCompletionChunk"),
    ):
        ok = paths[path]["post"]["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert chunk in str(ok["text/event-stream"]["schema"])
    error = document["components"]["schemas"]["ErrorInfo"]
    assert set(error["required"]) == {"message", "type"} and {"param", "code"} <= set(error["properties"])


def _tame(case) -> None:
    """Make a generated positive case one the server should serve: a valid prompt, the served model, fields
    clamped to their valid ranges, free-form constraints dropped."""
    if "model_id" in (case.path_parameters or {}):
        case.path_parameters["model_id"] = MODEL
    body = case.body
    if not isinstance(body, dict):
        return
    for key in DROPPED:
        body.pop(key, None)
    for key, value in VALID_INPUT.items():
        if key in body:
            body[key] = value
    if "prompt" in body:
        body.pop("messages", None)  # /tokenize takes one of them
    elif case.operation.path == "/tokenize" and "messages" not in body:
        body["prompt"] = VALID_INPUT["prompt"]  # its schema requires neither, the route one of them
    if "messages" in body and isinstance(body.get("logprobs"), bool):
        body["logprobs"] = body["logprobs"] or body.get("top_logprobs") is not None
    for key, (lo, hi) in RANGES.items():
        v = body.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            body[key] = type(v)(min(max(v, lo), hi))


def _bound(case) -> None:
    """Keep every positive case short: at most 4 new tokens (chat's default would be the rest of the context)
    and 2 samples, where a larger value would be valid; invalid values stay as generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    chat = case.operation.path == "/v1/chat/completions"
    if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    for key, hi, limit in (("max_tokens", 4, 512), ("max_completion_tokens", 4, 512), ("n", 2, 128)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and hi < v <= limit:
            body[key] = hi


def _run_operation(op, url: str, mode, examples: int, tally: collections.Counter, failures: list) -> None:
    positive = mode == schemathesis.GenerationMode.POSITIVE

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode), tame=st.booleans())
    def run(case, tame):
        if positive:
            _bound(case)
            if tame:
                _tame(case)
        try:
            r = case.call_and_validate(base_url=url, checks=CHECKS, timeout=HTTP_TIMEOUT_S)
        except Exception as e:  # a check failed: keep going, report all at the end
            failures.append(f"{op.label} {mode.value} {case.body!r:.300}\n{e}"[:3000])
            tally[(op.label, "failed")] += 1
            return
        tally[(op.label, r.status_code)] += 1

    run()


def test_schemathesis(server, document):
    """Every documented operation, POSITIVE_EXAMPLES positive and NEGATIVE_EXAMPLES negative cases (operations
    with a body): 0 server errors, 0 answers outside the documented statuses, media types and
    schemas; the generation routes answer 200 to some cases and 400 to others."""
    schema = schemathesis.openapi.from_dict(document)
    tally: collections.Counter = collections.Counter()
    failures: list[str] = []
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)
        _run_operation(op, server.url, schemathesis.GenerationMode.POSITIVE, POSITIVE_EXAMPLES, tally, failures)
        if op.body:  # a string path parameter has no invalid value: negative cases are bodies
            _run_operation(op, server.url, schemathesis.GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, tally, failures)
    documented = {f"{m.upper()} {p}" for p, ops in document["paths"].items() for m in ops}
    assert set(labels) == documented
    print(dict(sorted(tally.items(), key=str)))
    assert not failures, f"{len(failures)} failed cases; first:\n" + "\n\n".join(failures[:3])
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert tally[(label, 200)] > 0 and tally[(label, 400)] > 0, (label, tally)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
