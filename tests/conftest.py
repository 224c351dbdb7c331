"""Shared test fixtures: the reference checkpoints in ../shared/fixtures, the SmolLM2 GGUF (fetched once with pip),
and a persistent XLA compilation cache so repeated engine builds reuse compiled steps."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("NETRA_JAX_FIXTURES", REPO.parent / "shared" / "fixtures"))
TINY_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3"]
MOE_MODELS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"]  # mixture-of-experts fixtures


def int8_rounded(x):
    """float64 of float32 x [M, K] as the GGML kernel's int8 activations read it (netra_jax.ops.cpu_ggml_matmul): per
    block of 32, d = max|x| / 127 and q = x * (127 / max|x|) rounded to nearest even, in float32 as the kernel
    computes them, then d * q."""
    import numpy as np

    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)  # float32
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inverse)
    return (d.astype(np.float64) * q).reshape(m, k)


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


@contextlib.contextmanager
def compiled_jits() -> Iterator[list[str]]:
    """The names of the jitted functions XLA compiles inside the block, in order (jax's compile log)."""
    import jax

    names: list[str] = []

    class _Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("Finished XLA compilation of jit("):
                names.append(msg.split("(")[1].split(")")[0])

    handler, logger = _Log(), logging.getLogger("jax._src.dispatch")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def recorded_shapes(runner) -> Iterator[list]:
    """The step shapes `runner.shape_for` gives inside the block, in order (every step the engine runs asks it)."""
    used: list = []
    shape_for = runner.shape_for

    def recording(num_tokens, prompt_logprobs=False):
        shape = shape_for(num_tokens, prompt_logprobs)
        used.append(shape)
        return shape

    runner.shape_for = recording
    try:
        yield used
    finally:
        del runner.shape_for


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
