"""Per-step trace of the engine loop, opt-in (NETRA_STEP_TRACE=trace.jsonl): each step's composition (prefill and
decode tokens, sequences, token bucket and padding) and times (period, device, wait, host, CPU), one JSON line a step.

Nothing here runs unless a trace is installed: a `StepTrace` is an `EngineObserver` the engine calls at its loop's
events (`LLMEngine.trace_steps` adds one). `python -m netra_jax.engine.step_report trace.jsonl` summarizes a trace.

A line per completed step (`kind` "step"), in the order the host read their tokens:
  step            index of the step (dispatch order); t: seconds from the trace's start to its tokens' readiness
  prefill, decode tokens of prompts / past the prompt (decodes, speculative proposals, recompute after preemption)
  prefill_seqs, seqs, tokens, bucket, padding (bucket - tokens), seq_bucket (the shape's sequence rows)
  running, waiting    the scheduler's queues after scheduling this step
  period_ms       since the previous step's tokens were read: the interval a decoding sequence sees (None after idle)
  device_ms       its tokens' readiness minus when it could start (its dispatch, or the previous step's readiness)
  wait_ms         the host blocked on this step's tokens
  call_*          the engine.step() call that read it: call_ms wall, call_host_ms wall minus the waits in it,
                  call_cpu_ms the whole process's CPU time, call_engine_cpu_ms the engine thread's, call_xla_cpu_ms
                  XLA's compute threads' (in 1/CLK_TCK ticks; None without /proc). The rest of the process's CPU is
                  the server's other threads (HTTP, streaming): on a CPU backend all of it shares the cores.
The first line (`kind` "config") has the token buckets, the scheduler's settings and the machine's CPU."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

from netra_jax.engine.observer import EngineObserver

if TYPE_CHECKING:
    from netra_jax.engine.runner import StepResult
    from netra_jax.engine.sched_output import SchedulerOutput

__all__ = ["TRACE_ENV", "StepTrace", "composition", "trace_path_from_env", "xla_cpu_seconds"]

TRACE_ENV = "NETRA_STEP_TRACE"


def composition(out: SchedulerOutput) -> dict[str, int]:
    """Prompt and past-prompt tokens of a scheduled step and how many sequences carry each."""
    prefill = decode = prefill_seqs = 0
    for s in out.scheduled:
        prompt = max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.start))
        prefill += prompt
        decode += s.num_new_tokens - prompt
        prefill_seqs += prompt > 0
    return {
        "prefill": prefill,
        "decode": decode,
        "prefill_seqs": prefill_seqs,
        "seqs": len(out.scheduled),
        "tokens": prefill + decode,
    }


_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
XLA_THREAD_PREFIX = "tf_XLAEigen"  # XLA's CPU compute threads (one per core)


def xla_cpu_seconds(task_dir: str = "/proc/self/task") -> float | None:
    """CPU time so far of this process's XLA compute threads (the kernel's user + system ticks, so a resolution of
    1/CLK_TCK: meaningful summed over many steps); None where /proc is not there."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    ticks = 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if name.startswith(XLA_THREAD_PREFIX):
            fields = rest.split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks * _TICK


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class StepTrace(EngineObserver):
    """Records the steps of one engine as JSON lines in `path` (truncated), until `close`: an observer of the engine
    loop (`LLMEngine.trace_steps` adds one). facts: the engine's settings for the first line (buckets,
    max_num_batched_tokens, max_num_seqs, scheduler, async_scheduling); the CPU and the time are added here."""

    def __init__(self, path: str | os.PathLike, facts: dict) -> None:
        self.path = Path(path)
        self._file = open(self.path, "w", buffering=1)  # noqa: SIM115 (kept open for the engine's lifetime)
        self._dispatched: dict[int, dict] = {}  # id(SchedulerOutput) -> its line so far
        self._num_dispatched = 0
        self._last_ready: float | None = None
        self._read: list[dict] = []  # lines completed in the current step() call
        self._call: tuple[float, float, float, float | None] | None = None  # the call's start: wall, CPU clocks
        self._t0 = time.perf_counter()
        self._write({"kind": "config", **facts, "cpu": _cpu_model(), "num_cpus": os.cpu_count(), "time": time.time()})

    def _write(self, line: dict) -> None:
        if not self._file.closed:
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()

    # ------------------------------------------------------------------ the engine loop's events
    def step_started(self) -> None:
        t0 = time.perf_counter()
        p0, e0, x0 = time.process_time(), time.thread_time(), xla_cpu_seconds()  # process first: it encloses
        self._call = (t0, p0, e0, x0)

    def dispatched(self, sched: SchedulerOutput, result: StepResult, running: int, waiting: int) -> None:
        shape = result.batch.shape
        line = {"kind": "step", "step": self._num_dispatched, **composition(sched)}
        line["bucket"] = shape.num_tokens
        line["padding"] = shape.num_tokens - line["tokens"]
        line["seq_bucket"] = shape.num_seqs
        line["running"] = running
        line["waiting"] = waiting
        line["_dispatched_at"] = time.perf_counter()
        self._dispatched[id(sched)] = line
        self._num_dispatched += 1

    def tokens_read(self, sched: SchedulerOutput, started: float, wait: float) -> None:
        line = self._dispatched.pop(id(sched), None)
        if line is None:
            return
        ready = started + wait
        dispatched_at = line.pop("_dispatched_at")
        start = dispatched_at if self._last_ready is None else max(dispatched_at, self._last_ready)
        line["period_ms"] = None if self._last_ready is None else 1e3 * (ready - self._last_ready)
        line["device_ms"] = 1e3 * (ready - start)
        line["wait_ms"] = 1e3 * wait
        line["t"] = round(ready - self._t0, 4)
        self._last_ready = ready
        self._read.append(line)

    def step_done(self, wait: float, has_unfinished: bool) -> None:
        """The lines read in this call get its times (wall, host = wall - wait, the CPU seconds of the process, the
        engine thread and XLA's threads over it) and are written."""
        e1, p1, x1 = time.thread_time(), time.process_time(), xla_cpu_seconds()  # the engine thread's interval first
        wall_end = time.perf_counter()
        t0, p0, e0, x0 = self._call if self._call is not None else (wall_end, p1, e1, x1)
        self._call = None
        wall = wall_end - t0
        for line in self._read:
            line["call_ms"] = 1e3 * wall
            line["call_host_ms"] = 1e3 * (wall - wait)
            line["call_cpu_ms"] = 1e3 * (p1 - p0)
            line["call_engine_cpu_ms"] = 1e3 * (e1 - e0)
            line["call_xla_cpu_ms"] = None if x0 is None or x1 is None else 1e3 * (x1 - x0)
            self._write(line)
        self._read = []
        if not has_unfinished:  # idle: the next step's period starts afresh
            self._last_ready = None


def trace_path_from_env() -> str | None:
    """The trace file $NETRA_STEP_TRACE names (None: unset or empty, no trace)."""
    return os.environ.get(TRACE_ENV) or None
