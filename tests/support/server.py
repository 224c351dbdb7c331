"""The one harness for tests that start a real `netra-jax serve` process: launched on a free loopback port with its
log in a temporary file, ready once it prints its URL, stopped by SIGTERM; plus the readers of its /metrics,
/debug/engine and SSE bodies, and the official openai client pointed at it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families
from support.checkpoints import DATA, FIXTURES

MODEL = "tiny-qwen3"  # the default served fixture
READY = re.compile(r"ready on (http://[\d.]+:\d+)")
SMALL = ("--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--num-kv-pages", "64")  # a small engine


class ServerProcess:
    """One `python -m netra_jax.cli serve MODEL --host 127.0.0.1 --port 0 ARGS` process: its log, its URL once
    ready, and the child processes it had then (or was seen with since `note_children`)."""

    def __init__(self, *args: str, model: str | None = str(FIXTURES / MODEL), env: dict[str, str] | None = None):
        self.log = Path(tempfile.mkdtemp(prefix="netra-serve-")) / "server.log"
        cmd = [sys.executable, "-m", "netra_jax.cli", "serve", *([model] if model else [])]
        cmd += ["--host", "127.0.0.1", "--port", "0", *args]
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
        """The log so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern, timeout: float = 300) -> re.Match:
        """The first match of `pattern` in the log; AssertionError (with the log's tail) if the process exits or
        `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = pattern.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern.pattern!r} (rc={self.proc.poll()}):\n{self.text()[-4000:]}")

    def wait_ready(self, timeout: float = 300) -> ServerProcess:
        """Once the ready line is printed: its URL kept, the children noted. Killed if it never comes."""
        try:
            self.url = self.wait_for(READY, timeout).group(1)
        except AssertionError:
            self.kill()
            raise
        self.children = psutil.Process(self.pid).children(recursive=True)
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status (killed after `timeout` seconds)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def debug(self) -> dict:
        """/debug/engine (the server must run with --enable-debug-endpoints)."""
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


def start_server(
    *args: str, model: str | None = str(FIXTURES / MODEL), env: dict[str, str] | None = None, timeout: float = 300
) -> ServerProcess:
    """A ServerProcess, returned once ready."""
    return ServerProcess(*args, model=model, env=env).wait_ready(timeout)


@contextlib.contextmanager
def running_server(*args: str, **kw) -> Iterator[ServerProcess]:
    """start_server's process for the `with` block; stopped at its end, which must be a clean exit (status 0)."""
    s = start_server(*args, **kw)
    try:
        yield s
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.text()[-3000:]


EMBEDDING_MODEL = DATA / "tiny-qwen3-embed"  # this suite's tiny embedding checkpoint (tests/fixtures)


def embedding_server() -> contextlib.AbstractContextManager[ServerProcess]:
    """`running_server` of the tiny embedding model with --task embed and a 128-token context, as the embedding and
    scoring route tests use it."""
    options = ("--max-model-len", "128", "--max-num-batched-tokens", "128", "--max-num-seqs", "8")
    return running_server("--task", "embed", *options, model=str(EMBEDDING_MODEL))


def openai_client(server: ServerProcess, timeout: float = 120) -> openai.OpenAI:
    """The official client on `server`, without retries (a failure shows at once)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v"}': value}, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metrics_idle(url: str, timeout: float = 5.0) -> tuple[float, dict[str, float]]:
    """Seconds until /metrics shows no request running or waiting and no KV block referenced, and the metrics then."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        if (
            m["netra_kv_blocks_in_use"] == 0
            and m["netra_num_requests_running"] == 0
            and m["netra_num_requests_waiting"] == 0
            and m["netra_num_requests_unfinished"] == 0
        ):
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {m}")
        time.sleep(0.02)


def engine_idle(p: ServerProcess, timeout: float = 10.0) -> dict:
    """/debug/engine once no request is unfinished and no KV block is referenced, its block pool's invariant checked
    (AssertionError after timeout)."""
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


def log_softmax(row: list[float], i: int) -> float:
    """log p(i) under the softmax of `row` (a reference logits row), in float64."""
    m = max(row)
    return row[i] - m - math.log(sum(math.exp(x - m) for x in row))
