"""The engine loop's events, for code that watches the engine without changing it (the step trace; anything timing
or counting steps): subclass `EngineObserver`, override the events you need, `LLMEngine.add_observer` it.

Events run on the engine's thread inside `LLMEngine.step()`, in this order per call: `step_started`, then
`dispatched` for the step it schedules (if any) and `tokens_read` for the step whose tokens it reads (overlapped:
the one dispatched by the previous call), then `step_done`, also when the step raises. They must be cheap and must
not call back into the engine; an exception raised by one propagates and fails that step."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from netra_jax.engine.runner import StepResult
    from netra_jax.engine.sched_output import SchedulerOutput

__all__ = ["EngineObserver"]


class EngineObserver:
    """Every event a no-op: override the ones you need."""

    def step_started(self) -> None:
        """A `step()` call begins."""

    def dispatched(self, sched: SchedulerOutput, result: StepResult, running: int, waiting: int) -> None:
        """The runner dispatched `sched` as `result` (its packed batch has the shape); `running` and `waiting`: the
        scheduler's queue lengths after scheduling it."""

    def tokens_read(self, sched: SchedulerOutput, started: float, wait: float) -> None:
        """The host has `sched`'s sampled tokens: it asked for them at `started` (time.perf_counter()) and was
        blocked on the device for `wait` seconds."""

    def step_done(self, wait: float, has_unfinished: bool) -> None:
        """The `step()` call ended (returned or raised); `wait`: the seconds it spent blocked on the device;
        `has_unfinished`: requests are still queued or running (False: the engine is idle)."""
