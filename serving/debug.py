"""Introspection for tests and operators, mounted only with `netra-jax serve --enable-debug-endpoints`: GET
/debug/engine reads the engine's counters and checks the KV pool's invariant in the engine thread, between steps."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from netra_jax.engine.async_engine import EngineDeadError
from netra_jax.engine.engine import LLMEngine
from netra_jax.serving.errors import APIError
from netra_jax.serving.metrics import CompileCounter

CALL_TIMEOUT_S = 5.0


def engine_snapshot(engine: LLMEngine) -> dict:
    """Counters of the engine and its pool, and "ok" or the violated invariant (runs in the engine thread)."""
    pool, sched = engine.pool, engine.scheduler
    try:
        pool.check_invariant()
        invariant = "ok"
    except AssertionError as e:
        invariant = str(e)
    return {
        "requests_admitted": engine.num_requests,
        "has_unfinished": engine.has_unfinished_requests(),
        "running": sched.num_running,
        "waiting": sched.num_waiting,
        "preemptions": sched.num_preemptions,
        "blocks": {
            "total": pool.num_total,
            "free": pool.num_free,
            "cached": pool.num_cached,
            "in_use": pool.num_in_use,
        },
        "invariant": invariant,
    }


def install_debug_routes(app: FastAPI) -> None:
    st = app.state.server

    @app.get("/debug/engine")
    async def debug_engine() -> dict:
        try:
            snap = await asyncio.wait_for(st.engine.call(engine_snapshot), CALL_TIMEOUT_S)
        except (EngineDeadError, TimeoutError) as e:
            raise APIError(503, f"engine is not answering: {e!r}", code="engine_dead") from None
        snap.update(
            steps=st.engine.num_steps,
            streams=st.engine.num_unfinished,
            xla_compilations=CompileCounter.count,
            xla_compilations_outside_warmup=CompileCounter.outside_warmup,
            programs_pending=st.engine.engine.programs_pending,
            recent_compilations=list(CompileCounter.recent),
        )
        return snap
