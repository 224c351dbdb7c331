"""A real `netra-jax serve` process held in warm-up ($NETRA_JAX_WARMUP_GATE): it listens at once, /health answers
200 (liveness) while /ready and the generation routes answer 503, progress lines count the variants, and once
warm-up ends /ready turns 200 and requests are served."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conftest import FIXTURES
from test_server import MODEL, READY, SMALL, Server

from netra_jax.engine.warmup import GATE_ENV

LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")
PROGRESS = re.compile(r"compiling (step|widen|sampler) variant (\d+) of (\d+) \(")


def _wait_for(proc: subprocess.Popen, log: Path, pattern: re.Pattern, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = pattern.search(log.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no {pattern.pattern!r} (rc={proc.poll()}):\n{log.read_text(errors='replace')[-4000:]}")


def test_health_answers_while_warming_up_and_ready_after(tmp_path):
    gate = tmp_path / "warm-up may end"
    log = Path(tempfile.mkdtemp(prefix="netra-serve-")) / "server.log"
    cmd = [sys.executable, "-m", "netra_jax.cli", "serve", str(FIXTURES / MODEL), "--host", "127.0.0.1"]
    cmd += ["--port", "0", *SMALL]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", GATE_ENV: str(gate)}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    server = None
    try:
        url = _wait_for(proc, log, LISTENING).group(1)
        server = Server(proc, url, log)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        for _ in range(3):  # compiling, then held at the gate: the same answers throughout
            health, ready = httpx.get(url + "/health"), httpx.get(url + "/ready")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
            r = httpx.post(url + "/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and r.headers["retry-after"]
        _wait_for(proc, log, re.compile("waiting for " + re.escape(str(gate))))
        assert httpx.get(url + "/ready").status_code == 503  # compiled, still held: not ready yet
        steps = [m for m in PROGRESS.finditer(log.read_text()) if m.group(1) == "step"]
        assert [int(m.group(2)) for m in steps] == list(range(1, int(steps[0].group(3)) + 1))
        gate.touch()
        assert _wait_for(proc, log, READY).group(1) == url
        assert httpx.get(url + "/ready").status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "warm-up done in" in log.read_text()
    finally:
        if server is not None:
            server.stop()
        else:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
