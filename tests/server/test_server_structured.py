"""response_format through the OpenAI-compatible server (in-process uvicorn on tiny-qwen3, the official openai client):
json_schema on chat (plain, n > 1, streamed) and json_object on completions give outputs that parse and validate;
a schema llguidance cannot compile, or a json_schema without a schema, is a 400 naming response_format."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from support.checkpoints import FIXTURES
from support.schemas import SCHEMA, check_schema

MODEL = "tiny-qwen3"
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client():
    import uvicorn

    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig, SchedulerConfig
    from netra_jax.serving.app import create_app

    cfg = EngineConfig(
        model=str(FIXTURES / MODEL),
        warmup=False,
        cache=CacheConfig(num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    engine = AsyncEngine(build_engine(cfg))
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, MODEL, ready=lambda: True), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def test_chat_json_schema_plain_sampled_and_streamed(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=128, temperature=0, response_format=FORMAT
    )
    text = r.choices[0].message.content
    check_schema(json.loads(text))
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=128, temperature=1.0, seed=4, n=3, response_format=FORMAT
    )
    for c in r.choices:
        check_schema(json.loads(c.message.content))
        assert c.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=128, temperature=0, response_format=FORMAT, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)


def test_completions_json_object(client):
    body = {"response_format": {"type": "json_object"}}
    r = client.completions.create(
        model=MODEL,
        prompt=["A JSON object:", "{}", "Hello"],
        max_tokens=64,
        temperature=1.0,
        seed=0,
        n=2,
        extra_body=body,
    )
    assert len(r.choices) == 6 and all(c.text.startswith("{") for c in r.choices)
    done = [c for c in r.choices if c.finish_reason == "stop"]  # a free-form object may outgrow max_tokens
    assert len(done) >= 3 and all(isinstance(json.loads(c.text), dict) for c in done)


def test_bad_response_formats_are_400(client):
    bad = [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
    ]
    for fmt in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format=fmt)
        err = e.value.body
        assert err["param"] == "response_format" and err["code"] == "invalid_response_format", err
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"response_format": bad[0]})
    assert "nonsense" in e.value.body["message"]
    text = {"response_format": {"type": "text"}}
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, extra_body=text)
    assert ok.choices[0].finish_reason == "length"
