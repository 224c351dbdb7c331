"""A test file run again as its own process (a multi-device worker, a fake server): its environment (this process's,
plus the given variables and tests/ on PYTHONPATH so the worker imports `support` as the tests do), and the
multi-device worker that writes its results as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.checkpoints import REPO


def worker_env(**variables: str) -> dict[str, str]:
    path = [str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **variables, "PYTHONPATH": os.pathsep.join(path)}


def run_device_worker(script: str, out: Path, devices: int = 4, timeout: float = 900) -> dict:
    """Run `script` (a test file whose __main__ writes its results to the path it is given) on `devices` fake CPU
    devices and return the JSON it wrote; its output tail in the failure when it exits non-zero."""
    env = worker_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, script, str(out)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(Path(out).read_text())
