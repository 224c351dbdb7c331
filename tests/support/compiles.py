"""Probes of what the engine compiles: the jitted functions XLA compiles inside a block, and the step shapes a runner
asks for (both read by tests that assert "no recompilation" or "only these buckets")."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


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

    def recording(num_tokens, prompt_logprobs=False, lora=False):
        shape = shape_for(num_tokens, prompt_logprobs, lora)
        used.append(shape)
        return shape

    runner.shape_for = recording
    try:
        yield used
    finally:
        del runner.shape_for
