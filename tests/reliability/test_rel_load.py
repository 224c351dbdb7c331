"""Load: two waves of 512 concurrent streaming clients with random prompt and output lengths all complete without
error; RSS and KV blocks are flat across the second wave and nothing compiles after warm-up."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from reliability_harness import main_server, record, release_main_server
from support.server import engine_idle, sse_events

C = "/v1/completions"
CLIENTS = 512
RSS_TOLERANCE_KIB = 32 << 10  # allocator noise; a leak of one KV-sized or request-sized object per client is larger


@pytest.fixture(scope="module")
def server(request):
    yield main_server()
    release_main_server(request)


def _body(rng: random.Random) -> dict:
    """Warmed sampler variants only (greedy, plain, top-k/top-p; no penalties or bias, which compile on first use)."""
    n_prompt = rng.choice([rng.randrange(1, 16), rng.randrange(1, 200)])
    return {
        "prompt": [rng.randrange(3, 512) for _ in range(n_prompt)],
        "max_tokens": rng.randrange(1, 24),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "top_k": rng.choice([0, 20]),
        "seed": rng.randrange(1 << 30),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _client(http: httpx.AsyncClient, body: dict, start: asyncio.Event) -> str | None:
    """None when the stream is complete and consistent, else what went wrong."""
    await start.wait()
    try:
        async with asyncio.timeout(120):
            async with http.stream("POST", C, json=body) as r:
                lines = [line async for line in r.aiter_lines()]
    except Exception as e:  # noqa: BLE001 - counted as an error
        return f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"status {r.status_code}: {lines[:2]}"
    events = sse_events(lines)
    if not events or events[-1] != "[DONE]" or any("error" in e for e in events if isinstance(e, dict)):
        return f"bad stream end: {lines[-3:]}"
    usage = events[-2]["usage"]
    if usage["completion_tokens"] != body["max_tokens"] or usage["prompt_tokens"] != len(body["prompt"]):
        return f"usage {usage} for {len(body['prompt'])} + {body['max_tokens']}"
    reasons = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c.get("finish_reason")]
    return None if reasons == ["length"] else f"finish reasons {reasons}"


async def _wave(url: str, seed: int) -> list[str | None]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    start = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(_client(http, _body(rng), start)) for _ in range(CLIENTS)]
        await asyncio.sleep(0)
        start.set()
        return await asyncio.gather(*tasks)


def test_512_streaming_clients(server):
    engine_idle(server)
    d0 = server.debug()
    compiles0 = d0["xla_compilations_outside_warmup"]  # on the request path (not the background warm-up)
    t0 = time.monotonic()
    first = asyncio.run(_wave(server.url, 1))  # also brings the server's heap to its working size
    t1 = time.monotonic()
    idle1 = engine_idle(server, timeout=15)
    rss1 = server.rss_kib()
    second = asyncio.run(_wave(server.url, 2))
    t2 = time.monotonic()
    idle2 = engine_idle(server, timeout=15)
    rss2 = server.rss_kib()
    errors = [e for e in first + second if e is not None]
    record("load: clients held at once", CLIENTS)
    record("load: waves (s)", [round(t1 - t0, 1), round(t2 - t1, 1)])
    record("load: errors", len(errors))
    record("load: RSS after wave 1 / wave 2 (MiB)", [rss1 >> 10, rss2 >> 10])
    record("load: XLA compilations on the request path", idle2["xla_compilations_outside_warmup"] - compiles0)
    assert not errors, errors[:5]
    # no block leaked; how the free ones split between plain and prefix-cached depends on when each request's
    # blocks came back (overlapped scheduling learns of a finish one step later), so only their sum must match
    free1, free2 = (d["blocks"]["free"] + d["blocks"]["cached"] for d in (idle1, idle2))
    assert free2 == free1 == idle2["blocks"]["total"] and idle2["invariant"] == "ok"
    assert idle2["blocks"]["in_use"] == 0
    assert rss2 - rss1 < RSS_TOLERANCE_KIB, (rss1, rss2)
    assert idle2["xla_compilations_outside_warmup"] == compiles0, idle2["recent_compilations"]
    assert idle2["steps"] - d0["steps"] >= 2 * 23  # it did run (at least the longest output, twice)
    assert httpx.get(server.url + "/health").status_code == 200
