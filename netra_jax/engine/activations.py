"""Activations recorded by hooks, mapped back from a step's padded token rows to each request and position: what
`LLM.generate(..., hooks=...)` returns per request, padding removed."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from netra_jax.engine.scheduler import SchedulerOutput
from netra_jax.engine.step_layout import PackedBatch


class ActivationRecorder:
    """Collects each step's recorded rows per request id as (positions, rows) slices; `pop` assembles them in
    position order. A position computed twice (a preempted request recomputes its tokens) keeps the later rows."""

    def __init__(self) -> None:
        self._parts: dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]] = defaultdict(list)

    def collect(self, sched: SchedulerOutput, batch: PackedBatch, records: dict) -> None:
        """Take one step's records ({hook name: [T, ...]} device arrays) apart by request."""
        if not records:
            return
        host = {name: np.asarray(a) for name, a in records.items()}
        lay = batch.shape.layout
        qsl = lay.view(batch.host, "query_start_loc")
        positions = lay.view(batch.host, "positions")
        for s, sr in enumerate(sched.scheduled):
            lo, hi = int(qsl[s]), int(qsl[s + 1])
            rows = {name: a[lo:hi] for name, a in host.items()}
            self._parts[sr.request_id].append((positions[lo:hi].copy(), rows))

    def pop(self, request_id: str, num_positions: int) -> dict[str, np.ndarray]:
        """The request's activations {hook name: [num_positions, ...]}, row p for the token at position p (the
        prompt, then every output token but the last, which the model never ran on); forgets them.
        RuntimeError if a position was never computed."""
        parts = self._parts.pop(request_id, [])
        if not parts:
            raise RuntimeError(f"no activations were recorded for request {request_id!r}")
        out: dict[str, np.ndarray] = {}
        seen = np.zeros(num_positions, bool)
        for positions, rows in parts:
            keep = positions < num_positions  # a step run after the request had finished
            seen[positions[keep]] = True
            for name, r in rows.items():
                if name not in out:
                    out[name] = np.zeros((num_positions, *r.shape[1:]), r.dtype)
                out[name][positions[keep]] = r[keep]
        if not seen.all():
            raise RuntimeError(f"request {request_id!r}: positions {np.flatnonzero(~seen)[:8].tolist()} not computed")
        return out

    def discard(self, request_id: str) -> None:
        self._parts.pop(request_id, None)

    def clear(self) -> None:
        self._parts.clear()
