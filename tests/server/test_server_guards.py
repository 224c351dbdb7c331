"""Server guards on a real process started with --api-key, --max-body-bytes, --cors-origins and a small waiting
queue: 401 on every route but /health, 413, CORS preflight, 429 with Retry-After, and SIGTERM draining in-flight
streams before exiting 0. In-process: /ready before warm-up and a dead engine answer 503 with the envelope."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.checkpoints import FIXTURES
from support.server import MODEL, start_server

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)


@pytest.fixture(scope="module")
def server():
    s = start_server(
        "--api-key",
        KEY,
        "--max-body-bytes",
        "4096",
        "--cors-origins",
        ORIGIN,
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--num-kv-pages",
        "64",
        "--drain-timeout",
        "30",
        "--chat-template",
        TEMPLATE,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def app_routes():
    """(method, path) of every route the app declares, from an app built in-process around a tiny engine."""
    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig
    from netra_jax.serving.app import create_app

    ae = AsyncEngine(
        build_engine(EngineConfig(model=str(FIXTURES / MODEL), warmup=False, cache=CacheConfig(num_pages=8)))
    )
    app = create_app(ae, MODEL, api_key=KEY)
    routes = []
    for r in app.routes:
        path = r.path.replace("{model_id:path}", MODEL)
        for m in sorted(getattr(r, "methods", None) or {"GET"}):
            routes.append((m, path))
    ae.shutdown()
    return routes


def test_api_key_on_every_route(server, app_routes):
    paths = {p for _, p in app_routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/ready", "/docs"} <= paths
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in app_routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = http.request(method, path, headers=headers)
                if path == "/health":
                    assert r.status_code == 200
                    continue
                assert r.status_code == 401, f"{method} {path} {headers}: {r.status_code}"
                if method != "HEAD":
                    assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
        assert http.get("/metrics", headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_server_chat_template(server):
    """--chat-template replaces the checkpoint's template for chat and /tokenize alike."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        got = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        text = "<system>Be brief.\n<user>Hi there\n<bot>"
        assert got == http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
        assert r["usage"]["prompt_tokens"] == len(got)


def test_body_limit(server):
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        r = http.post("/v1/completions", json=big)  # Content-Length says too much
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the cap applies to the bytes received
            yield b'{"model": "tiny-qwen3", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'", "max_tokens": 1}'

        r = http.post("/v1/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/completions", json={**big, "prompt": "x" * 100}).status_code == 200


def test_cors_preflight(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": ORIGIN, **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_queue_full_answers_429(server):
    """One running sequence and a waiting cap of 4: of 10 simultaneous requests some are refused with 429."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    gate = threading.Barrier(10)

    def one(_):
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            gate.wait()
            return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(10) as ex:
        results = list(ex.map(one, range(10)))
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 100


def test_sigterm_drains_in_flight_then_exits_0(server):
    """Runs last in this module: it stops the server."""
    msgs = [{"role": "user", "content": "go"}]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 300,
        "n": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[str] = []
    started = threading.Event()

    def consume():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if '"content":"' in line and '"content":""' not in line:
                        started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(server.url + "/health", timeout=5)
    t.join(60)
    assert server.proc.wait(60) == 0
    assert events[-1] == "data: [DONE]"
    assert sum('"finish_reason":"length"' in e for e in events) == 3
    assert '"completion_tokens":900' in events[-2]
    log = server.log.read_text()
    assert "draining (1 in flight" in log and "stopped" in log


# ---------------------------------------------------------------------------------------------------- in-process
def test_ready_and_dead_engine_in_process():
    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig
    from netra_jax.serving.app import create_app

    engine = build_engine(EngineConfig(model=str(FIXTURES / MODEL), warmup=False, cache=CacheConfig(num_pages=16)))
    ae = AsyncEngine(engine)
    warm = [False]
    app = create_app(ae, MODEL, ready=lambda: warm[0])
    body = {"prompt": [1, 2, 3], "max_tokens": 3}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            r = await http.get("/ready")
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and r.headers["retry-after"]
            warm[0] = True
            assert (await http.get("/ready")).status_code == 200
            assert (await http.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"] == 3

            def boom():
                raise RuntimeError("injected step failure")

            engine.step = boom
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert (await http.get("/health")).status_code == 503
            assert (await http.get("/ready")).status_code == 503
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    asyncio.run(main())
    ae.shutdown()
