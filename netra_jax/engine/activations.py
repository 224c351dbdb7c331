"""Activations recorded by hooks, mapped back from a step's padded token rows to each request and position: what
`LLM.generate(..., hooks=...)` returns per request, padding removed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np

from netra_jax.engine.scheduler import SchedulerOutput
from netra_jax.engine.step_layout import PackedBatch


class ActivationRecorder:
    """Collects each step's recorded rows per request id as (positions, rows) slices; `pop` assembles them in
    position order. A position computed twice (a preempted request recomputes its tokens) keeps the later rows."""

    def __init__(self) -> None:
        self._parts: dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]] = defaultdict(list)

    def collect(
        self, sched: SchedulerOutput, batch: PackedBatch, records: dict, wanted: Callable[[str], Iterable[str]]
    ) -> None:
        """Take one step's records ({hook name: [T, ...]} device arrays) apart by request: of each scheduled request
        the names `wanted(request_id)` lists (its own hook set's; none for a request without hooks)."""
        if not records:
            return
        host = {name: np.asarray(a) for name, a in records.items()}
        lay = batch.shape.layout
        qsl = lay.view(batch.host, "query_start_loc")
        positions = lay.view(batch.host, "positions")
        for s, sr in enumerate(sched.scheduled):
            names = [n for n in wanted(sr.request_id) if n in host]
            lo, hi = int(qsl[s]), int(qsl[s + 1])
            if names and hi > lo:
                rows = {name: host[name][lo:hi] for name in names}
                self._parts[sr.request_id].append((positions[lo:hi].copy(), rows))

    def pop_samples(self, request_ids: list[str], prompt_len: int, num_positions: list[int]) -> list[dict]:
        """The activations of the samples of one request (same prompt, same hooks), each {hook name:
        [num_positions[i], ...]}: row p for the token at position p (the prompt, then every output token but the
        last, which the model never ran on); forgets them. A prompt position one sample took from another's cached
        blocks comes from the sample that computed it. An attention pattern's key axis is cut or zero-padded to
        the sample's positions (key j: position j), whatever each step spanned. RuntimeError if a position was never
        computed."""
        parts = {rid: self._parts.pop(rid, []) for rid in request_ids}
        shared = [(pos, rows) for ps in parts.values() for pos, rows in ps]  # the prompt rows of any sample
        out = []
        for rid, n in zip(request_ids, num_positions, strict=True):
            prompt = [(pos, rows) for pos, rows in shared if (pos < prompt_len).any()]
            out.append(self._assemble(rid, [*prompt, *parts[rid]], prompt_len, n))
        return out

    @staticmethod
    def _assemble(request_id: str, parts: list, prompt_len: int, num_positions: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        seen = np.zeros(num_positions, bool)
        for positions, rows in parts:
            keep = positions < num_positions  # a step run after the request had finished
            seen[positions[keep]] = True
            for name, r in rows.items():
                if name.endswith(".pattern"):  # [rows, heads, keys]: keys past the sequence are zero
                    r = r[..., :num_positions]
                    r = np.pad(r, ((0, 0), (0, 0), (0, num_positions - r.shape[-1])))
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
