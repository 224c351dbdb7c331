"""The test map and the suite-wide fixtures. Each folder of tests/ is one kind of test and marks its tests with its
name (`pytest -m unit`, `-m "not server"`): see tests/README.md. Fixtures: a persistent XLA compilation cache so
repeated engine builds reuse compiled steps, compiled executables dropped after each module, the SmolLM2 GGUF."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# folder -> what its tests exercise (the markers registered in pyproject.toml, one per folder)
FOLDERS = {
    "unit": "host-side pieces alone: scheduler, block pool, tokenizers, parsers, protocol, configuration, layering",
    "kernels": "attention, matmul and sampler kernels against float64 or jnp references",
    "models": "model functions, weight maps and checkpoint loaders against transformers",
    "engine": "the engine and the Python API in-process: batching, caching, speculation, hooks",
    "server": "real `netra-jax serve` and CLI processes, batch jobs and Ray, through the openai client",
    "reliability": "real servers under bad input, disconnects, faults, load and a small KV pool",
    "benchmarks": "the benchmark tools on tiny inputs: their parsers, reports and dry runs",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's name; a test file outside the map fails the collection."""
    for item in items:
        rel = item.path.resolve().relative_to(HERE)
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        if folder not in FOLDERS:
            raise pytest.UsageError(f"{rel}: tests live in one of tests/{{{','.join(FOLDERS)}}}/ (tests/README.md)")
        item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    from netra_jax.engine.factory import enable_compilation_cache

    enable_compilation_cache(os.environ.get("NETRA_JAX_TEST_XLA_CACHE") or None)


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """Drop jax's compiled executables after each test module. jit caches keep every executable of a module-level
    function (one per static config and shape) for the life of the process, and each is JIT code in its own memory
    maps: the whole suite in one process would pass the kernel's map limit (vm.max_map_count, 65530), where the next
    compilation fails to map its code and the unwinder crashes on that error."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from netra_jax.assets import default_model_path

    return default_model_path()
