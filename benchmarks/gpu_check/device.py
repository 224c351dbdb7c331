"""Section `device`: what the check runs on (jax, device kind, memory) and the two ceilings the other sections are
measured against: device-to-device copy bandwidth (bytes read + written) and the bf16 matrix-product rate, both
on random data."""

from __future__ import annotations

import platform
import subprocess

import jax
import jax.numpy as jnp

from benchmarks.gpu_check.common import Section, median_time, sig


def describe() -> dict:
    d = jax.devices()[0]
    info = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": d.device_kind,
        "num_devices": jax.device_count(),
    }
    stats = d.memory_stats() or {}
    if stats.get("bytes_limit"):
        info["memory_gib"] = round(stats["bytes_limit"] / 2**30, 1)
    if jax.default_backend() == "gpu":
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[-1] if smi.returncode == 0 else smi.stderr[-300:]
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    return info


def copy_bandwidth(n_bytes: int, copies: int = 2) -> float:
    """GB/s of a large elementwise copy (x + 1 in bf16): 2 * n_bytes moved per call, inputs rotated."""
    n = n_bytes // 2
    keys = jax.random.split(jax.random.key(1), copies)
    xs = [jax.random.normal(k, (n,), jnp.bfloat16) for k in keys]
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = median_time(lambda i: f(xs[i % copies]), jax.block_until_ready, reps=5, inner=4)
    return 2 * n * 2 / t / 1e9


def matmul_tflops(m: int) -> float:
    """TFLOP/s of an m x m x m bf16 product on random data."""
    a, b = (jax.random.normal(k, (m, m), jnp.bfloat16) for k in jax.random.split(jax.random.key(2)))
    f = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.bfloat16))
    t = median_time(lambda i: f(a, b), jax.block_until_ready, reps=5, inner=5)
    return 2 * m**3 / t / 1e12


def run(sec: Section) -> None:
    sec.set("env", describe())
    if not sec.dry and jax.default_backend() != "gpu":
        raise RuntimeError(f"no GPU visible to jax (backend {jax.default_backend()}); use --dry-run on a CPU machine")
    sec.set("copy_gbps", sig(copy_bandwidth((8 << 20) if sec.dry else (4 << 30))))
    sec.set("matmul_tflops", sig(max(matmul_tflops(m) for m in ((256,) if sec.dry else (4096, 8192)))))
