"""A real `netra-jax serve` process held in warm-up ($NETRA_JAX_WARMUP_GATE): it listens at once, /health answers
200 (liveness) while /ready and the generation routes answer 503, progress lines count the variants, and once
warm-up ends /ready turns 200 and requests are served."""

from __future__ import annotations

import re

import httpx
from support.server import MODEL, READY, SMALL, ServerProcess

from netra_jax.engine.warmup import GATE_ENV

LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")
PROGRESS = re.compile(r"(?:compiling|loading) (step|widen|sampler) variant (\d+) of (\d+) \(")


def test_health_answers_while_warming_up_and_ready_after(tmp_path):
    gate = tmp_path / "warm-up may end"
    server = ServerProcess(*SMALL, env={GATE_ENV: str(gate)})
    try:
        url = server.wait_for(LISTENING).group(1)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        for _ in range(3):  # compiling, then held at the gate: the same answers throughout
            health, ready = httpx.get(url + "/health"), httpx.get(url + "/ready")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
            r = httpx.post(url + "/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and r.headers["retry-after"]
        server.wait_for(re.compile("waiting for " + re.escape(str(gate))))
        assert httpx.get(url + "/ready").status_code == 503  # compiled, still held: not ready yet
        steps = [m for m in PROGRESS.finditer(server.text()) if m.group(1) == "step"]
        assert [int(m.group(2)) for m in steps] == list(range(1, int(steps[0].group(3)) + 1))
        gate.touch()
        assert server.wait_for(READY).group(1) == url
        assert httpx.get(url + "/ready").status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "warm-up done in" in server.text()
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.text()[-3000:]
