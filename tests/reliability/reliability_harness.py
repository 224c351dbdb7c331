"""Shared pieces of the reliability suite: `netra-jax serve` processes launched side by side on free loopback ports
(one main server shared by every module), readers for /metrics and /debug/engine, RSS and child-process probes."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from conftest import FIXTURES
from test_server import MODEL, READY, scrape

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


class Proc:
    """One server process: its command line, log, URL once ready."""

    def __init__(self, args: tuple[str, ...], env: dict[str, str] | None = None, model: str = str(FIXTURES / MODEL)):
        self.log = Path(tempfile.mkdtemp(prefix="netra-rel-")) / "server.log"
        cmd = [sys.executable, "-m", "netra_jax.cli", "serve", model, "--host", "127.0.0.1", "--port", "0", *args]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
            )
        self.url = ""
        self.children: list[psutil.Process] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 420) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY.search(self.text())
            if m:
                self.url = m.group(1)
                self.children = psutil.Process(self.pid).children(recursive=True)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server not ready (rc={self.proc.poll()}):\n{self.text()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after 60 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def debug(self) -> dict:
        r = httpx.get(self.url + "/debug/engine", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def note_children(self) -> None:
        """Remember the server's current child processes (call before stopping it)."""
        self.children += psutil.Process(self.pid).children(recursive=True)

    def leftover_children(self) -> list[int]:
        """Children seen at start-up or noted since that still run; call after the server exited."""
        return [c.pid for c in self.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def launch(*args: str, env: dict[str, str] | None = None) -> Proc:
    return Proc(tuple(args), env)


_MAIN: list[Proc] = []


MAIN_USERS = ("server", "tiny")  # fixtures of this directory that use the shared server


def main_server() -> Proc:
    """The shared server, started on first use; `release_main_server` or the end of the test process stops it."""
    if not _MAIN:
        p = launch(*MAIN_ARGS)
        atexit.register(p.stop)
        _MAIN.append(p.wait_ready())
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


def wait_idle(p: Proc, timeout: float = 10.0) -> dict:
    """/debug/engine once no request is unfinished and no KV block is referenced (AssertionError after timeout)."""
    t0 = time.monotonic()
    while True:
        d = p.debug()
        if not d["has_unfinished"] and d["streams"] == 0 and d["blocks"]["in_use"] == 0:
            assert d["invariant"] == "ok", d
            b = d["blocks"]
            assert b["free"] + b["cached"] == b["total"], d
            return d
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {d}")
        time.sleep(0.05)


def sse_events(lines: list[str]) -> list[dict | str]:
    """The `data:` payloads of an SSE body: parsed JSON objects, and "[DONE]"."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


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
