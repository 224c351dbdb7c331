"""A compiling process of the compile check (a `concurrent.futures` worker, started by spawn): `init` gives it the
compilers' reporting environment and its own dump directory before jax loads; `run` runs one job there."""

from __future__ import annotations

import os
import tempfile

from benchmarks.gpu_compile import capture, jobs

_DUMP: str | None = None


# set by jax's Mosaic GPU module when it is imported, from where that process found the CUDA wheels ("None" where it
# found none): a parent's values would point this process's Mosaic at the wrong (or no) CUDA and crash its compiles
INHERITED_PATHS = ("MOSAIC_GPU_CUDA_ROOT", "MOSAIC_GPU_NVSHMEM_BC_PATH", "MOSAIC_GPU_NVSHMEM_SO_PATH")


def init() -> None:
    global _DUMP
    _DUMP = tempfile.mkdtemp(prefix="gpu_compile-dump-")
    for name in INHERITED_PATHS:
        os.environ.pop(name, None)
    os.environ.update(capture.compiler_env(_DUMP))


def run(job: tuple) -> dict:
    if _DUMP is None:
        raise RuntimeError("gpu_compile.worker.init() must run first (the pool's initializer)")
    return jobs.run_job(job, _DUMP)


def plan(target: str, model: str) -> int:
    """How many step variants `model`'s engine compiles on `target` (its runner is built here, not in the parent;
    the CUDA plugin's start-up log is left out)."""
    with capture.captured():
        return len(jobs.step_shapes(target, model))
