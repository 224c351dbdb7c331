"""What the step profilers share: the options every sub-command takes, the float32 engine they profile, timing of a
call until its result is ready, A/B runs interleaved, and the record and file of a result (benchmarks/results)."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_MODEL = "SmolLM2-135M-Instruct (default)"


class OptionError(ValueError):
    """An option value a sub-command cannot use: reported as argparse reports its own (usage, exit status 2)."""


def add_options(
    p: argparse.ArgumentParser,
    *,
    repeats: int,
    repeats_help: str | None = None,
    model_help: str = "a checkpoint (default: the embedded SmolLM2-135M-Instruct)",
    out_help: str = "result JSON path (default benchmarks/results/<date>-<name>.json)",
) -> None:
    """--model, --repeats and --out, which every sub-command takes."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument("--out", default=None, help=out_help)


def model_label(model: str | None) -> str:
    """The model as a result names it."""
    return model or DEFAULT_MODEL


def build_llm(model: str | None, **options):
    """`LLM(model)` in float32, the dtype every profile runs; `options` go to LLM (its defaults are serve's)."""
    from netra_jax import LLM

    return LLM(model, dtype="float32", **options)


def alternating(names: Sequence, rep: int) -> list:
    """`names` in order on even repeats and reversed on odd ones: what is compared runs interleaved, so that the
    machine's background load hits each alike."""
    return list(names) if rep % 2 == 0 else list(names)[::-1]


def time_call(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall s, process CPU s over all threads) of `fn()` until its result is ready on the device."""
    import jax

    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def median_time(fn: Callable[[], object], repeats: int, min_time: float = 0.0) -> tuple[float, list[float]]:
    """Median seconds of `fn()` over `repeats` calls (after one untimed call); keeps going until `min_time` spent."""
    fn()
    times: list[float] = []
    t_start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - t_start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * repeats:
            break
    return statistics.median(times), times


class Run:
    """One profiling run: the load average when it began, then its result document and the file it goes to."""

    def __init__(self, benchmark: str):
        self.benchmark = benchmark
        self.load0 = os.getloadavg()

    def record(self, **fields) -> dict:
        """The result document: `fields` between the benchmark's name and date and what the run ran on (JAX's
        platform and version, the machine, the load average at the start and now)."""
        import jax

        from netra_jax.bench.machine import machine_info

        return {
            "benchmark": self.benchmark,
            "date": datetime.date.today().isoformat(),
            **fields,
            "platform": jax.default_backend(),
            "jax": jax.__version__,
            "machine": machine_info(),
            "load_average_before_after": [self.load0, os.getloadavg()],
        }

    def write(self, doc: dict, out: str | None, label: str = "") -> Path:
        """`doc` as JSON to `out`, else to benchmarks/results/<date>-<benchmark>[_<label>].json; the path."""
        from netra_jax.bench.results import write_result

        return write_result(doc, self.benchmark + (f"_{label}" if label else ""), RESULTS, out)
