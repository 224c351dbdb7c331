"""Injected engine faults (NETRA_JAX_FAULT_STEP): a step that raises, and one that hangs past --step-timeout, fail
every in-flight request with an error envelope, turn /health to 503 and make the server exit with status 3."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from reliability_harness import ENVELOPE_KEYS, launch, record
from support.server import sse_events

C = "/v1/completions"
FAULT_STEP = 150  # late enough that every request is admitted and streaming first
ARGS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--num-kv-pages", "64", "--enable-debug-endpoints")
BODY = {"prompt": [4, 5, 6], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
ENGINE_DEAD_EXIT = 3


@pytest.fixture(scope="module")
def faulty():
    procs = {
        "raise": launch(*ARGS, env={"NETRA_JAX_FAULT_STEP": str(FAULT_STEP)}),
        "hang": launch(*ARGS, "--step-timeout", "2", env={"NETRA_JAX_FAULT_STEP": f"{FAULT_STEP}:hang"}),
    }
    try:
        yield {k: p.wait_ready() for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()


def _drive(server) -> dict:
    """Three streams and one JSON request in flight when the fault hits; then /health and the exit status."""
    out: dict = {"streams": [None] * 3, "json": None}

    def stream(i: int) -> None:
        with httpx.stream("POST", server.url + C, json={**BODY, "stream": True}, timeout=60) as r:
            out["streams"][i] = (r.status_code, sse_events(list(r.iter_lines())))

    def plain() -> None:
        out["json"] = httpx.post(server.url + C, json=BODY, timeout=60)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=plain)]
    for t in threads:
        t.start()
    server.note_children()
    for t in threads:
        t.join(60)
    out["health"] = httpx.get(server.url + "/health", timeout=10)
    t0 = time.monotonic()
    out["rc"] = server.proc.wait(60)
    out["exit_after_s"] = time.monotonic() - t0
    return out


def _check(server, out: dict, kind: str) -> None:
    for status, events in out["streams"]:
        assert status == 200 and events[-1] == "[DONE]"
        tokens = [c for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"] if c["text"]]
        assert tokens, "the stream was in flight (had tokens) when the fault hit"
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and set(errors[0]) == ENVELOPE_KEYS and errors[0]["type"] == "service_unavailable"
        assert not any(c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices", []))
    r = out["json"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    h = out["health"]
    assert h.status_code == 503 and set(h.json()["error"]) == ENVELOPE_KEYS
    assert out["rc"] == ENGINE_DEAD_EXIT, server.text()[-3000:]
    assert f"exiting with status {ENGINE_DEAD_EXIT}" in server.text()
    assert server.leftover_children() == []
    record(
        f"fault ({kind}): in-flight requests failed / exit status / exit after (s)",
        [4, out["rc"], round(out["exit_after_s"], 1)],
    )


def test_step_that_raises(faulty):
    server = faulty["raise"]
    out = _drive(server)
    _check(server, out, "step raises")
    assert f"injected fault in step {FAULT_STEP}" in server.text()


def test_step_that_hangs_trips_the_watchdog(faulty):
    server = faulty["hang"]
    out = _drive(server)
    _check(server, out, "step hangs")
    assert f"engine step {FAULT_STEP} has run for" in server.text()


def test_watchdog_fails_clients_of_a_step_stuck_in_native_code():
    """In process: a step that ignores shutdown (as a stuck device call would). The watchdog fails the client; the
    engine reports dead while its thread is still stuck; when the step finally returns, the loop stops."""
    import asyncio

    from support.checkpoints import FIXTURES
    from support.server import MODEL

    from netra_jax import SamplingParams
    from netra_jax.engine.async_engine import AsyncEngine, EngineDeadError
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig

    engine = build_engine(EngineConfig(model=str(FIXTURES / MODEL), warmup=False, cache=CacheConfig(num_pages=8)))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("warm", [1, 2, 3], params)  # compile the shapes used below, so only the stuck step is slow
    while engine.has_unfinished_requests():
        engine.step()
    release = threading.Event()
    real_step, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 3:
            release.wait(30)
        return real_step()

    engine.step = step
    ae = AsyncEngine(engine, step_timeout=1.0)

    async def main():
        outs = []
        with pytest.raises(EngineDeadError, match="engine step 3 has run for"):
            async for o in ae.generate([1, 2, 3], params, "r"):
                outs.append(o)
        return outs

    t0 = time.monotonic()
    outs = asyncio.run(main())
    # steps 1 and 2 finished (overlapped, step 2 returns only step 1's token: its own comes with step 3)
    assert len(outs) == (1 if engine.overlap else 2) and time.monotonic() - t0 < 5
    assert not ae.is_alive and ae.loop_running  # dead, and the thread is still inside the step
    release.set()
    ae.shutdown(timeout=10)
    assert not ae.loop_running and ae.num_steps == 2  # the late step's outputs went nowhere
