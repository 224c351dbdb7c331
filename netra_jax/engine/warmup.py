"""Warm-up: every program the engine's configuration can reach (step buckets, the widening of sampled ids, sampler
variants) traced and lowered in turn and compiled in parallel threads (XLA releases the GIL), with progress."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import jax

from netra_jax.engine.step_layout import BatchShape
from netra_jax.ops import sampling

if TYPE_CHECKING:
    from netra_jax.engine.runner import ModelRunner

__all__ = [
    "GATE_ENV",
    "Variant",
    "WarmupReport",
    "compile_variants",
    "default_workers",
    "engine_variants",
    "sampler_label",
    "step_label",
    "warm_up",
]

log = logging.getLogger(__name__)

GATE_ENV = "NETRA_JAX_WARMUP_GATE"  # a file path: warm-up ends only once it exists (holds a server in warm-up)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Variant:
    """One compiled program the engine calls: `lower` traces and lowers it with the arguments the engine passes, so
    compiling the result fills the jit's own caches and the engine's first call of it compiles nothing."""

    kind: str  # "step" | "widen" | "sampler" | "logprobs"
    label: str  # what makes it a variant, for progress lines: "128 tokens, 64 rows"
    lower: Callable[[], jax.stages.Lowered] = field(compare=False, repr=False)


@dataclass
class WarmupReport:
    """What a warm-up compiled, in the order compiles were started, and where its seconds went."""

    compiled: list[tuple[str, str]]  # (kind, label) of each variant
    workers: int
    lower_s: float = 0.0  # tracing and lowering (Python, one thread)
    seconds: float = 0.0  # wall time of the whole warm-up


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def step_label(shape: BatchShape) -> str:
    """A step variant in a progress line, e.g. "128 tokens, 64 rows" (the logit rows sampled), with its sequences
    when speculation widens the rows, and its prompt-logprob rows."""
    parts = [_count(shape.num_tokens, "token")]
    if shape.num_rows != shape.num_seqs:
        parts.append(_count(shape.num_seqs, "sequence"))
    parts.append(_count(shape.num_rows, "row"))
    if shape.prompt_rows:
        parts.append(_count(shape.prompt_rows, "prompt-logprob row"))
    return ", ".join(parts)


def sampler_label(num_rows: int, key: sampling.SamplingKey) -> str:
    return f"{_count(num_rows, 'row')}, {'greedy' if key.all_greedy else 'sampled'}"


def _lower_sampler(num_rows: int, vocab_size: int, key: sampling.SamplingKey) -> jax.stages.Lowered:
    """The token program as the engine calls it: a step's logits and numpy row parameters."""
    logits, _ = sampling.example_inputs(num_rows, vocab_size)
    arrays = sampling.dummy_arrays(key, num_rows, vocab_size)
    return sampling.sample_tokens.trace(logits, arrays, key=key).lower()


def _lower_logprobs(num_rows: int, vocab_size: int) -> jax.stages.Lowered:
    """The logprob program as the engine calls it: a step's logits, the token program's output and the rows'
    parameters (no bias, penalty or mask)."""
    key = sampling.logprob_key(sampling.SamplingKey(False, 0, 0, True))
    arrays = jax.device_put(sampling.dummy_arrays(key, num_rows, vocab_size))
    return sampling.token_logprobs.trace(*sampling.example_inputs(num_rows, vocab_size), arrays, key=key).lower()


def engine_variants(
    runner: ModelRunner, vocab_size: int, keys: Sequence[sampling.SamplingKey] | None = None
) -> list[Variant]:
    """Every program the engine may call for `runner`'s configuration: each reachable step shape
    (`ModelRunner.all_shapes`), largest first (the longest compiles start first); with overlapped steps the
    widening of each sampled-row count; then, for each sampled-row count, the sampler's common token programs
    (`sampling.variant_keys`) and its logprob program. Penalty, bias and grammar-mask token programs compile on
    first use."""
    shapes = sorted(runner.all_shapes(), key=lambda s: (-s.num_tokens, -s.prompt_rows))
    rows = sorted({s.num_rows for s in shapes})
    out = [Variant("step", step_label(s), partial(runner.lower_step, s)) for s in shapes]
    if runner.overlap:
        out += [Variant("widen", _count(r, "row"), partial(runner.lower_widen, r)) for r in rows]
    keys = sampling.variant_keys() if keys is None else keys
    for r in rows:
        out += [Variant("sampler", sampler_label(r, k), partial(_lower_sampler, r, vocab_size, k)) for k in keys]
        out.append(Variant("logprobs", _count(r, "row"), partial(_lower_logprobs, r, vocab_size)))
    return out


def default_workers() -> int:
    """Compile threads: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def compile_variants(
    variants: Sequence[Variant], *, workers: int | None = None, progress: Progress | None = None
) -> WarmupReport:
    """Trace and lower each variant in this thread (tracing holds the GIL) and compile it in a pool of `workers`
    threads as soon as it is lowered, so lowering the next one overlaps the compiles; returns once all are compiled
    (the first compile error is raised). Each compiled program lands in its jit's caches and, when configured, in
    jax's persistent compilation cache. `progress` gets one line per variant ("compiling step variant 3 of 16
    (...)") as its compile starts; by default they are logged at INFO."""
    t0 = time.perf_counter()
    workers = workers or default_workers()
    say = progress or log.info
    totals = Counter(v.kind for v in variants)
    seen: Counter[str] = Counter()
    report = WarmupReport([], workers)
    futures: list[Future] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="netra-compile") as pool:
        try:
            for v in variants:
                t = time.perf_counter()
                lowered = v.lower()
                report.lower_s += time.perf_counter() - t
                seen[v.kind] += 1
                say(f"compiling {v.kind} variant {seen[v.kind]} of {totals[v.kind]} ({v.label})")
                report.compiled.append((v.kind, v.label))
                futures.append(pool.submit(lowered.compile))
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    report.seconds = time.perf_counter() - t0
    return report


def warm_up(
    runner: ModelRunner,
    vocab_size: int,
    *,
    embedder=None,
    proposer=None,
    progress: Progress | None = None,
    workers: int | None = None,
) -> WarmupReport:
    """Compile everything an engine of these parts may call before it serves: the runner's reachable step variants,
    widenings and sampler variants (`engine_variants`, through `compile_variants`), then the speculative `proposer`'s
    own programs; with an `embedder` (task "embed"): its embedding buckets instead."""
    t0 = time.perf_counter()
    if embedder is not None:
        embedder.warmup()
        report = WarmupReport([], 1)
    else:
        report = compile_variants(engine_variants(runner, vocab_size), workers=workers, progress=progress)
        if proposer is not None:
            (progress or log.info)("compiling the speculative proposer's variants")
            proposer.warmup()
    _wait_for_gate(progress or log.info)
    report.seconds = time.perf_counter() - t0
    return report


def _wait_for_gate(say: Progress) -> None:
    """Hold here while $NETRA_JAX_WARMUP_GATE names a file that does not exist yet (tests observe a server in
    warm-up with it)."""
    gate = os.environ.get(GATE_ENV)
    if not gate or os.path.exists(gate):
        return
    say(f"warm-up compiled; waiting for {gate} to exist (${GATE_ENV})")
    event = threading.Event()
    while not os.path.exists(gate):
        event.wait(0.05)
