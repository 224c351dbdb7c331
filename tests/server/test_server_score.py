"""POST /v1/score and the rerank routes (/rerank, /v1/rerank, /v2/rerank) on a real `netra-jax serve --task embed`
process (tiny-qwen3-embed): every score equals the cosine similarity of the embeddings /v1/embeddings returns for
the same texts; vLLM's 1:1, 1:N and N:N pairings under each of its field names; rerank order, top_n,
return_documents, Jina's `{"text": ...}` documents and Cohere v2's `meta`; usage counting each distinct text once;
the 400s (bad bodies, pairings, context length), the 404 of an unknown model, and a generative server's 400."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient
from support.checkpoints import FIXTURES
from support.server import EMBEDDING_MODEL, embedding_server

from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.engine.factory import build_engine
from netra_jax.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from netra_jax.serving.app import create_app

EMBED = EMBEDDING_MODEL
MODEL = EMBED.name
CASES = [c for c in json.loads((EMBED / "reference.json").read_text())["cases"] if c["text"] is not None]
TEXTS = [c["text"] for c in CASES]
TOKENS = {c["text"]: len(c["ids"]) for c in CASES}  # with the <|endoftext|> the tokenizer appends
QUERY = TEXTS[1]  # "What is the capital of France?"
LONG = (TEXTS[4] + " ") * 3  # over the 128-token context
TOL = 1e-5
SCORE_ROUTES = ("/v1/score", "/score")
RERANK_ROUTES = ("/v1/rerank", "/rerank", "/v2/rerank")
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
GENERATED_EXAMPLES = 10  # schemathesis cases per scoring operation (test_openapi.py's run is on a generating server)


@pytest.fixture(scope="module")
def server():
    with embedding_server() as s:
        yield s


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def ok(server, route: str, body: dict) -> dict:
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    return r.json()


def embeddings(server, texts: list[str], **extra) -> np.ndarray:
    """/v1/embeddings' float vectors of `texts`: [len(texts), hidden] float64."""
    body = {"input": texts, "encoding_format": "float", **extra}
    return np.array([d["embedding"] for d in ok(server, "/v1/embeddings", body)["data"]], np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of [n, d] and [n, d] (or [d] broadcast): [n]."""
    a, b = np.broadcast_arrays(a, b)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def scores(resp: dict) -> list[float]:
    assert [d["index"] for d in resp["data"]] == list(range(len(resp["data"])))
    assert all(d["object"] == "score" for d in resp["data"])
    return [d["score"] for d in resp["data"]]


@pytest.fixture(scope="module")
def reference(server) -> dict[str, np.ndarray]:
    """Each text's embedding as /v1/embeddings returns it."""
    return dict(zip(TEXTS, embeddings(server, TEXTS), strict=True))


# ---------------------------------------------------------------------------------------------------- /v1/score
def test_one_to_n_scores_are_embedding_cosines(server, reference):
    """One text_1 against every text_2 (itself included): the cosines of /v1/embeddings' vectors, in text_2's order;
    usage counts each distinct text once (text_1 is also a text_2)."""
    for route in SCORE_ROUTES:
        resp = ok(server, route, {"model": MODEL, "text_1": QUERY, "text_2": TEXTS})
        want = cosine(reference[QUERY], np.array([reference[t] for t in TEXTS]))
        np.testing.assert_allclose(scores(resp), want, atol=TOL)
        assert scores(resp)[1] == pytest.approx(1.0, abs=TOL)  # the query with itself
        assert resp["object"] == "list" and resp["model"] == MODEL and resp["id"].startswith("score-")
        assert isinstance(resp["created"], int)
        n = sum(TOKENS.values())
        assert (resp["usage"]["prompt_tokens"], resp["usage"]["total_tokens"]) == (n, n)


def test_pairings_and_vllm_field_names(server, reference):
    """1:1 (strings or one-element lists) and N:N (the i-th with the i-th) under text_1/text_2 and vLLM's other
    names (data_1/data_2, queries/documents, queries/items); repeated texts are embedded once."""
    one = ok(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[2]})
    np.testing.assert_allclose(scores(one), [cosine(reference[TEXTS[0]], reference[TEXTS[2]])], atol=TOL)
    assert scores(ok(server, "/v1/score", {"text_1": [TEXTS[0]], "text_2": [TEXTS[2]]})) == pytest.approx(
        scores(one), abs=TOL
    )
    left, right = TEXTS[:4], TEXTS[1:5]
    want = cosine(np.array([reference[t] for t in left]), np.array([reference[t] for t in right]))
    for a, b in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
        resp = ok(server, "/v1/score", {a: left, b: right, "request_id": "pairs"})
        np.testing.assert_allclose(scores(resp), want, atol=TOL)
        assert resp["id"] == "score-pairs"
        assert resp["usage"]["total_tokens"] == sum(TOKENS[t] for t in TEXTS)  # 5 distinct texts of 8
    same = ok(server, "/v1/score", {"text_1": TEXTS[3], "text_2": [TEXTS[3]] * 3})
    assert scores(same) == pytest.approx([1.0] * 3, abs=TOL) and same["usage"]["total_tokens"] == TOKENS[TEXTS[3]]


def test_truncation_as_embeddings(server, reference):
    """truncate_prompt_tokens keeps each text's last k tokens, as /v1/embeddings does with the same value."""
    long = embeddings(server, [LONG], truncate_prompt_tokens=100)[0]
    resp = ok(server, "/v1/score", {"text_1": LONG, "text_2": TEXTS[0], "truncate_prompt_tokens": 100})
    np.testing.assert_allclose(scores(resp), [cosine(long, reference[TEXTS[0]])], atol=TOL)
    assert resp["usage"]["prompt_tokens"] == 100 + TOKENS[TEXTS[0]]


# ---------------------------------------------------------------------------------------------------- rerank
def test_rerank_orders_documents_by_cosine(server, reference):
    """Every document scored against the query, results by descending relevance_score, each with its index and its
    text; the same on the three routes, /v2/rerank with Cohere's meta; usage counts the query once."""
    want = cosine(reference[QUERY], np.array([reference[t] for t in TEXTS]))
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])
    for route in RERANK_ROUTES:
        resp = ok(server, route, {"model": MODEL, "query": QUERY, "documents": TEXTS})
        results = resp["results"]
        assert [r["index"] for r in results] == order, (route, results)
        np.testing.assert_allclose([r["relevance_score"] for r in results], want[order], atol=TOL)
        assert [r["document"] for r in results] == [{"text": TEXTS[i]} for i in order]
        assert results[0]["index"] == 1 and results[0]["relevance_score"] == pytest.approx(1.0, abs=TOL)
        assert resp["id"].startswith("rerank-") and resp["model"] == MODEL
        n = sum(TOKENS.values())  # the query is also documents[1]: embedded once
        assert resp["usage"] == {"prompt_tokens": n, "total_tokens": n}
        if route == "/v2/rerank":
            assert resp["meta"] == {"api_version": {"version": "2"}, "tokens": {"input_tokens": n, "output_tokens": 0}}
        else:
            assert "meta" not in resp


def test_rerank_top_n_return_documents_and_jina_documents(server, reference):
    """top_n keeps the best n (0, absent, null or more than the documents: all); return_documents: false drops the
    texts; `{"text": ...}` documents (Jina, Cohere) score as their strings; one string is one document (vLLM)."""
    docs = [TEXTS[0], TEXTS[2], TEXTS[4]]
    full = ok(server, "/rerank", {"query": QUERY, "documents": docs})["results"]
    top = ok(server, "/rerank", {"query": QUERY, "documents": docs, "top_n": 2})["results"]
    assert top == full[:2]
    for everything in (0, 3, 10, None):
        assert ok(server, "/rerank", {"query": QUERY, "documents": docs, "top_n": everything})["results"] == full
    bare = ok(server, "/v1/rerank", {"query": QUERY, "documents": docs, "return_documents": False})["results"]
    assert bare == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in full]
    jina = [{"text": docs[0]}, docs[1], {"text": docs[2]}]  # Jina's / Cohere's objects, mixed with strings
    assert ok(server, "/v1/rerank", {"query": QUERY, "documents": jina})["results"] == full
    one = ok(server, "/v2/rerank", {"query": QUERY, "documents": docs[1]})["results"]  # a single string (vLLM)
    assert [(r["index"], r["document"]) for r in one] == [(0, {"text": docs[1]})]
    np.testing.assert_allclose(one[0]["relevance_score"], cosine(reference[QUERY], reference[docs[1]]), atol=TOL)


def test_answers_match_the_openapi_document(server):
    """The embedding server's answers (200s included, which test_openapi.py's generating server never gives here)
    conform to the served document: explicit bodies, then generated ones with the served model and no priority."""
    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json())
    score = {"text_1": QUERY, "text_2": TEXTS[:3], "request_id": "doc"}
    rerank = {"query": QUERY, "documents": [TEXTS[0], {"text": TEXTS[2]}], "top_n": 1}
    explicit, statuses = [], []
    for route in SCORE_ROUTES + RERANK_ROUTES:
        op = schema[route]["POST"]
        bodies = [score] if route in SCORE_ROUTES else [rerank, {**rerank, "return_documents": False}]
        for body in bodies:
            explicit.append(op.Case(body=body).call_and_validate(base_url=server.url, checks=CHECKS).status_code)

        @settings(
            max_examples=GENERATED_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
        def generated(case):
            if isinstance(case.body, dict):
                for key in ("model", "priority", "truncate_prompt_tokens"):
                    case.body.pop(key, None)
            statuses.append(case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60).status_code)

        generated()
    assert explicit == [200] * 8 and set(statuses) == {200, 400}, (explicit, statuses)


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "route, body, param, message",
    [
        ("/v1/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_2", "1:1, 1:N or N:N"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": "a"}, "text_2", "got 2 and 1 texts"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
        ("/v1/score", {"text_1": "a"}, "text_2", "missing field text_2"),
        ("/v1/score", {"documents": ["a"]}, "queries", "missing field queries"),
        ("/v1/score", {}, "text_1", "text_1 and text_2, data_1 and data_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "data_1": "c"}, "data_1", "not allowed with text_1"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2", "text_2[1] must not be an empty string"),
        ("/v1/score", {"text_1": "a", "text_2": LONG}, "text_2", "maximum context length is 128 tokens"),
        ("/v1/score", {"text_1": 5, "text_2": "b"}, "text_1", None),
        ("/v1/score", {"text_1": [[1, 2]], "text_2": "b"}, "text_1.0", "valid string"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "input": "c"}, "input", "unrecognized"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "max"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", None),
        ("/v1/score", {"text_1": "a", "text_2": "b", "priority": 2}, "priority", "scheduling-policy priority"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"documents": ["a"]}, "query", "missing required field"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "query must not be an empty string"),
        ("/v1/rerank", {"query": LONG, "documents": ["a"]}, "query", "maximum context length is 128 tokens"),
        ("/v1/rerank", {"query": "a", "documents": ["b", LONG]}, "documents", "documents[1]: This model's maximum"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", None),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 1.5}, "top_n", None),
        ("/v1/rerank", {"query": "a", "documents": [{"txt": "b"}]}, "documents.0", None),
        ("/v2/rerank", {"query": "a", "documents": ["b"], "return_documents": "yes"}, "return_documents", None),
        ("/rerank", {"query": ["a"], "documents": ["b"]}, "query", None),
    ],
)
def test_bad_input_is_a_400(server, route, body, param, message):
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if message:
        assert message in err["message"], err


def test_unknown_model_is_a_404_and_bad_json_a_400(server):
    for route, body in (
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ):
        r = post(server, route, {**body, "model": "bge-reranker"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/v1/score", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_generative_server_refuses_embeddings_and_scoring():
    """A --task generate app answers /v1/embeddings and the scoring routes with a 400 naming the route and --task
    embed (before any device work), after the body and model checks."""
    config = EngineConfig(
        model=str(FIXTURES / "tiny-qwen3"),
        cache=CacheConfig(num_pages=16),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
        max_model_len=64,
        warmup=False,
    )
    engine = AsyncEngine(build_engine(config))
    try:
        with TestClient(create_app(engine, "tiny-qwen3")) as http:
            answers = {route: http.post(route, json={"text_1": "a", "text_2": "b"}) for route in SCORE_ROUTES} | {
                route: http.post(route, json={"query": "a", "documents": ["b"]}) for route in RERANK_ROUTES
            }
            answers["/v1/embeddings"] = http.post("/v1/embeddings", json={"input": "hello"})
            bad_body = http.post("/v1/score", json={"text_1": "a", "txt_2": "b"})
            unknown = http.post("/v1/rerank", json={"model": "x", "query": "a", "documents": ["b"]})
    finally:
        engine.shutdown()
    for route, r in answers.items():
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["code"] == "unsupported_task" and "--task embed" in err["message"] and route in err["message"], err
    assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "txt_2"
    assert unknown.status_code == 404
