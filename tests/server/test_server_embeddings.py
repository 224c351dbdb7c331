"""POST /v1/embeddings on a real `netra-jax serve --task embed` process (tiny-qwen3-embed, Qwen3-Embedding's
layout), driven by the official openai client: float and base64 (the client's default) against transformers'
reference, Matryoshka dimensions, token-id inputs, concurrent requests, usage, 400s in OpenAI's envelope for bad
input and for generation routes; and the 400 a generative server answers on /v1/embeddings (in process)."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from support.server import EMBEDDING_MODEL, embedding_server, openai_client

from netra_jax.serving.embeddings import encode_embedding
from netra_jax.serving.protocol_embeddings import EmbeddingRequest

EMBED = EMBEDDING_MODEL
MODEL = EMBED.name
CASES = json.loads((EMBED / "reference.json").read_text())["cases"]
TEXTS = [c for c in CASES if c["text"] is not None]
TOL = 1e-4


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def server():
    with embedding_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_base64_and_float_match_reference(server, client):
    """The client's default (base64, decoded by the client to floats) and encoding_format="float" both give
    sentence-transformers' last-token embeddings of every text case, in input order, with usage counting the
    tokens the tokenizer gives (an <|endoftext|> appended to each text)."""
    texts = [c["text"] for c in TEXTS]
    plain = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for resp in (plain, floats):
        assert resp.object == "list" and resp.model == MODEL
        assert [d.index for d in resp.data] == list(range(len(texts)))
        assert all(d.object == "embedding" for d in resp.data)
        got = np.array([d.embedding for d in resp.data])
        np.testing.assert_allclose(got, [c["last"] for c in TEXTS], atol=TOL)
        n = sum(len(c["ids"]) for c in TEXTS)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")  # little-endian float32
    np.testing.assert_allclose(decoded, TEXTS[0]["last"], atol=TOL)
    assert raw["id"].startswith("embd-")


def test_token_ids_dimensions_and_extras(server, client):
    ids_cases = [c for c in CASES if c["text"] is None]
    resp = client.embeddings.create(model=MODEL, input=[c["ids"] for c in ids_cases], dimensions=16)
    want = [unit(np.array(c["hidden"])[-1][:16]) for c in ids_cases]  # truncated, then normalized again
    np.testing.assert_allclose([d.embedding for d in resp.data], want, atol=TOL)
    one = client.embeddings.create(model=MODEL, input=ids_cases[0]["ids"], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, ids_cases[0]["last"], atol=TOL)
    body = {"input": ids_cases[1]["ids"], "normalize": False, "truncate_prompt_tokens": 50, "request_id": "abc"}
    raw = httpx.post(server.url + "/v1/embeddings", json=body).json()
    assert raw["id"] == "embd-abc" and raw["usage"]["prompt_tokens"] == 50
    assert np.linalg.norm(raw["data"][0]["embedding"]) > 1.5  # unnormalized: the raw hidden state
    bare = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[0]["text"], "add_special_tokens": False})
    assert bare.json()["usage"]["prompt_tokens"] == len(TEXTS[0]["ids"]) - 1  # without the appended <|endoftext|>


def test_concurrent_requests_equal_sequential(client):
    inputs = [c["ids"] for c in CASES] * 2
    alone = [client.embeddings.create(model=MODEL, input=x).data[0].embedding for x in inputs]
    with ThreadPoolExecutor(len(inputs)) as pool:
        together = list(pool.map(lambda x: client.embeddings.create(model=MODEL, input=x).data[0].embedding, inputs))
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[1, 2], []]}, "input", "input[1]: prompt_token_ids is empty"),
        ({"input": [1, 2, 512]}, "input", "outside the vocabulary"),
        ({"input": list(range(1, 130))}, "input", "maximum context length is 128 tokens"),
        ({"input": "x", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "greater than max_model_len"),
        ({"input": "x", "dimensions": 65}, "dimensions", "larger than the model's embedding size"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than 0"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format", None),
        ({"input": "x", "embed_dtype": "fp8"}, "embed_dtype", None),
        ({"input": "x", "priority": 3}, "priority", "scheduling-policy priority"),
        ({"input": "x", "messages": []}, "messages", "unrecognized"),
        ({"input": [1, "a"]}, "input", None),
    ],
)
def test_bad_input_is_a_400(server, body, param, message):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if message:
        assert message in err["message"], err


def test_long_input_with_truncation(client):
    long = list(range(1, 201))
    resp = client.embeddings.create(
        model=MODEL, input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": 100}
    )
    want = client.embeddings.create(model=MODEL, input=long[-100:], encoding_format="float")
    np.testing.assert_allclose(resp.data[0].embedding, want.data[0].embedding, atol=1e-6)
    assert resp.usage.prompt_tokens == 100


def test_generation_routes_refused_other_routes_served(server, client):
    with pytest.raises(openai.BadRequestError, match="--task embed") as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "unsupported_task"
    with pytest.raises(openai.BadRequestError, match="--task generate"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]["text"]}).json()
    assert tok["tokens"] == TEXTS[0]["ids"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_base64_dtypes_and_byte_orders():
    v = np.array([0.5, -1.25, 3.0], np.float32)
    for dtype, order, numpy_dtype in (
        ("float32", "little", "<f4"),
        ("float32", "big", ">f4"),
        ("float16", "little", "<f2"),
    ):
        req = EmbeddingRequest(input="x", encoding_format="base64", embed_dtype=dtype, endianness=order)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encode_embedding(v, req)), numpy_dtype), v)
    req = EmbeddingRequest(input="x", encoding_format="base64", embed_dtype="bfloat16")
    raw = np.frombuffer(base64.b64decode(encode_embedding(v, req)), "<u2").astype(np.uint32) << 16
    np.testing.assert_array_equal(raw.view(np.float32), v)  # exact in bfloat16
