"""Interventions through the Python API: a weight swap that can be undone as a context manager, and what a hooked
forward of one prompt returns. The hook points themselves are `netra_jax.models.hooks`, the read-only view of the
live weights `netra_jax.models.frozen_params`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine


@dataclass
class HookedOutput:
    """`LLM.run_with_hooks`'s result for one prompt.

    Attributes:
        token_ids: The prompt's token ids.
        logits: [len(token_ids), vocab] float32; row i predicts token i + 1.
        activations: {hook name: [len(token_ids), ...]} of the recorded hook points.
    """

    token_ids: list[int]
    logits: np.ndarray
    activations: dict[str, np.ndarray]


class ParamsUpdate:
    """Returned by `LLM.update_params`: the new weights are live already; used as a context manager, the previous
    weights come back on exit (and the prefix cache is dropped again)."""

    def __init__(self, engine: LLMEngine, previous: Any) -> None:
        self._engine = engine
        self.previous = previous

    def __enter__(self) -> ParamsUpdate:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the previous weights back (the requests must have finished, as for any update)."""
        self._engine.update_params(self.previous)
