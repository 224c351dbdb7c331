"""Activation caches and patching sweeps through the Python API: what `LLM.run_with_cache` returns per prompt, and a
sweep that writes a clean run's activations into a corrupted prompt at every (hook point, position) in batched calls.

The sweep is one `LLM.generate` call: each (point, position) patch is a request of the corrupted prompt, all sharing
one hook set (`netra_jax.models.hooks.patch` at every swept point, a per-request mask as data), so the engine packs
as many of them into each compiled step as `max_num_batched_tokens` allows and nothing compiles per patch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from netra_jax.models.hooks import Hooks, patch
from netra_jax.models.transformer import unembed

if TYPE_CHECKING:  # (the LLM is netra_jax.api's, which imports this module)
    from netra_jax.engine.engine import PromptType


@dataclass
class CachedRun:
    """One prompt's recorded activations (`LLM.run_with_cache`).

    Attributes:
        token_ids: The prompt's token ids.
        activations: {hook name: [len(token_ids), ...]}: row p the activation at position p (an attention pattern:
            [len, heads, len], key j = position j; "logits": [len, vocab] float32).
    """

    token_ids: list[int]
    activations: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.activations[name]


@dataclass
class PatchingSweep:
    """The result of `patching_sweep`: the corrupted prompt's next-token logits with each patch applied.

    Attributes:
        points: The hook names swept (rows of `logits`).
        positions: The positions swept (columns of `logits`).
        logits: [points, positions, vocab] float32, the last position's logits with the clean activation of
            points[i] written at positions[j] of the corrupted prompt (nothing else changed).
        clean_logits: [vocab] the clean prompt's last-position logits.
        corrupted_logits: [vocab] the corrupted prompt's, unpatched.
        seconds: Wall time of the batched patched runs.
    """

    points: list[str]
    positions: list[int]
    logits: np.ndarray
    clean_logits: np.ndarray
    corrupted_logits: np.ndarray
    seconds: float

    def metric(self, fn: Callable[[np.ndarray], float]) -> np.ndarray:
        """fn(logits [vocab]) of every patch: [points, positions] float64 (e.g. a logit difference)."""
        return np.array([[fn(row) for row in per_point] for per_point in self.logits], np.float64)

    def normalized(self, fn: Callable[[np.ndarray], float]) -> np.ndarray:
        """The metric rescaled so that 0 is the corrupted run's value and 1 the clean run's: [points, positions]."""
        lo, hi = fn(self.corrupted_logits), fn(self.clean_logits)
        return (self.metric(fn) - lo) / (hi - lo)


def _last_logits(llm: LLM, runs: list[CachedRun]) -> np.ndarray:  # noqa: F821
    """[N, vocab] float32 next-token logits from each run's recorded final norm (its last row)."""
    last = jnp.asarray(np.stack([r["final_norm"][-1] for r in runs]))  # [N, hidden]
    return np.asarray(unembed(llm.params, llm.model_config, last))


def patching_sweep(
    llm: LLM,  # noqa: F821 (netra_jax.api imports this module)
    clean: PromptType,
    corrupted: PromptType,
    points: Sequence[str],
    positions: Sequence[int] | None = None,
    use_tqdm: bool = False,
) -> PatchingSweep:
    """Activation patching over hook points x positions: run the clean prompt, record `points`, then run the
    corrupted prompt once per (point, position) with that one activation replaced by the clean run's, all patched
    runs batched in one engine call. The prompts must have the same number of tokens (positions align).

    Args:
        llm: The engine.
        clean: The prompt whose activations are written.
        corrupted: The prompt they are written into.
        points: Hook names to sweep, e.g. every layer's "layers.{i}.resid_pre".
        positions: Positions to sweep (default: all).
        use_tqdm: Show a progress bar over the patched runs.

    Returns:
        A PatchingSweep with the last position's logits of every patched run.
    """
    points = list(points)
    base = llm.run_with_cache([clean, corrupted], names=[*points, "final_norm"])
    P = len(base[0].token_ids)
    if len(base[1].token_ids) != P:
        raise ValueError(f"the clean and corrupted prompts must have as many tokens ({P} and {len(base[1].token_ids)})")
    positions = list(range(P)) if positions is None else [int(p) for p in positions]
    if any(not 0 <= p < P for p in positions):
        raise ValueError(f"positions must be in 0..{P - 1}, got {positions}")
    R = len(points) * len(positions)  # request r = i * len(positions) + j patches points[i] at positions[j]
    data = {}
    for i, name in enumerate(points):
        mask = np.zeros((R, P), bool)
        for j, p in enumerate(positions):
            mask[i * len(positions) + j, p] = True
        data[name] = {"values": base[0][name], "mask": mask}
    hooks = Hooks(edit={name: patch for name in points}, data=data)
    t0 = time.perf_counter()
    runs = llm.run_with_cache([corrupted] * R, names=["final_norm"], hooks=hooks, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - t0
    logits = _last_logits(llm, runs).reshape(len(points), len(positions), -1)
    clean_logits, corrupted_logits = _last_logits(llm, base)
    return PatchingSweep(points, positions, logits, clean_logits, corrupted_logits, seconds)
