"""Import guard for the GPU check's dry run (tests/benchmarks/test_gpu_check.py puts this directory on PYTHONPATH): a
third-party module imports only when a distribution it comes from is in the GPU image's package list or among the
wheels the check carries, so the dry run fails here on what would be missing on the GPU machine. The project's own
packages import: netra_jax is netra-jax's, and the benchmarks package the check runs from belongs to no distribution."""

import importlib.abc
import importlib.metadata
import os
import re
import sys
from pathlib import Path


def _names(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {_norm(s) for s in (line.strip() for line in lines) if s and not s.startswith("#")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _ImageOnly(importlib.abc.MetaPathFinder):
    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.dists = importlib.metadata.packages_distributions()

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if name != top or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return None
        dists = {_norm(d) for d in self.dists.get(top, ())}
        if dists and not dists & self.allowed:
            # ModuleNotFoundError, as on the GPU machine: optional imports (starlette's python_multipart) catch it
            raise ModuleNotFoundError(
                f"{top} ({', '.join(sorted(dists))}) is neither on the GPU image nor a carried wheel", name=top
            )
        return None


_bench = Path(os.environ.get("GPU_CHECK_BENCHMARKS") or Path(__file__).resolve().parents[2] / "benchmarks")
_allowed = _names(_bench / "gpu_image_packages.txt") | _names(_bench / "gpu_wheels.txt") | {"netra-jax"}
sys.meta_path.insert(0, _ImageOnly(_allowed))
