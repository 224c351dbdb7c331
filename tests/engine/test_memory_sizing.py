"""The engine's GPU memory sizing: gpu_memory_utilization sizes jax's allocator (vLLM's meaning, a share of the
device's memory) when it can, and is applied once; the KV cache takes KV_SHARE of what the weights leave."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netra_jax.engine import runner

CLAIM = """
import os
from netra_jax.engine.runner import claim_gpu_memory
before = {v: os.environ.get(v) for v in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
if STARTED:
    import jax
    jax.devices()
print(claim_gpu_memory(0.9), os.environ.get("XLA_CLIENT_MEM_FRACTION"), before["XLA_PYTHON_CLIENT_MEM_FRACTION"])
"""


def _claim(started: bool, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in runner.FRACTION_ENV}
    r = subprocess.run(
        [sys.executable, "-c", CLAIM.replace("STARTED", repr(started))],
        env=clean | env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split("\n")[-2]


def test_the_allocator_is_sized_before_jax_starts_and_only_then():
    assert _claim(False) == "True 0.9 None"
    assert _claim(True) == "False None None"  # jax's backends are up: too late, left alone
    # a fraction the user chose wins (and jax refuses both variables together)
    assert _claim(False, XLA_PYTHON_CLIENT_MEM_FRACTION="0.5") == "False None 0.5"


def test_utilization_is_applied_once(monkeypatch):
    monkeypatch.setattr(runner, "_claimed_fraction", None)
    assert runner.usable_bytes(1000, 0.9) == pytest.approx(900)  # the allocator was not sized: a share of its limit
    monkeypatch.setattr(runner, "_claimed_fraction", 0.9)
    assert runner.usable_bytes(1000, 0.9) == 1000  # its limit already is 0.9 of the device
    assert runner.usable_bytes(1000, 0.5) == pytest.approx(500)
    # the KV cache gets KV_SHARE of what the weights leave; the rest is the activations' margin
    assert runner.kv_budget(1000, 200) == int(800 * runner.KV_SHARE)
