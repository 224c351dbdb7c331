"""Shared pieces of the reliability suite on top of the server harness (support/server.py): one main server shared by
every module of this directory and stopped after its last user, bounded gathers, and the figures it prints."""

from __future__ import annotations

import asyncio
import atexit
from pathlib import Path

from support.server import ServerProcess

# Every module shares this server; its pool is large enough that nothing is preempted, its body cap small enough
# that a body over it is cheap to send.
MAIN_ARGS = (
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "128",
    "--num-kv-pages",
    "256",
    "--max-body-bytes",
    str(1 << 20),
    "--enable-debug-endpoints",
)
MAX_BODY = 1 << 20
ENVELOPE_KEYS = {"message", "type", "param", "code"}
FIGURES: dict[str, object] = {}  # printed at the end of the session (see docs/reliability.md)


def launch(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A tiny-qwen3 server with these flags, not yet waited for (several start side by side)."""
    return ServerProcess(*args, env=env)


_MAIN: list[ServerProcess] = []


MAIN_USERS = ("server", "tiny")  # fixtures of this directory that use the shared server


def main_server() -> ServerProcess:
    """The shared server, started on first use; `release_main_server` or the end of the test process stops it."""
    if not _MAIN:
        p = launch(*MAIN_ARGS)
        atexit.register(p.stop)
        _MAIN.append(p.wait_ready(420))
    p = _MAIN[0]
    assert p.proc.poll() is None, f"the shared server exited:\n{p.text()[-3000:]}"
    return p


def release_main_server(request) -> None:
    """At a module fixture's teardown: stop the shared server unless a later test of this directory uses it."""
    here = Path(__file__).parent
    users = [
        it
        for it in request.session.items
        if Path(str(it.fspath)).parent == here and set(MAIN_USERS) & set(getattr(it, "fixturenames", ()))
    ]
    if _MAIN and (not users or users[-1].module is request.module):
        assert _MAIN[0].stop() == 0, _MAIN[0].text()[-3000:]
        _MAIN.clear()


async def gather_bounded(coros, limit: int):
    """Run the coroutines with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def record(name: str, value) -> None:
    FIGURES[name] = value
    print(f"[reliability] {name}: {value}", flush=True)
