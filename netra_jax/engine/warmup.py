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
from typing import TYPE_CHECKING, Any

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
    # the program's key in the table its call site reads compiled programs from (`ModelRunner.programs`): the runner's
    # `step_key` / `widen_key`, the sampler's `token_program_key` / `logprob_program_key`
    key: tuple = ()


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


def _lower_sampler(
    num_rows: int, vocab_size: int, key: sampling.SamplingKey, compile_for: jax.Device | None = None
) -> jax.stages.Lowered:
    """The token program as the engine calls it: a step's logits and numpy row parameters."""
    logits, _ = sampling.example_inputs(num_rows, vocab_size, compile_for)
    arrays = sampling.dummy_arrays(key, num_rows, vocab_size)
    return sampling.sample_tokens.trace(logits, arrays, key=key).lower()


def _lower_logprobs(
    num_rows: int, vocab_size: int, key: sampling.SamplingKey, compile_for: jax.Device | None = None
) -> jax.stages.Lowered:
    """The logprob program as the engine calls it: a step's logits, the token program's output and the rows'
    parameters, placed on the device (no bias, penalty or mask)."""
    arrays = sampling.dummy_arrays(key, num_rows, vocab_size)
    if compile_for is None:
        arrays = jax.device_put(arrays)
    else:
        on = jax.sharding.SingleDeviceSharding(compile_for)
        arrays = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), arrays)
    logits, tokens = sampling.example_inputs(num_rows, vocab_size, compile_for)
    return sampling.token_logprobs.trace(logits, tokens, arrays, key=key).lower()


def engine_variants(
    runner: ModelRunner, vocab_size: int, keys: Sequence[sampling.SamplingKey] | None = None
) -> list[Variant]:
    """Every program the engine may call for `runner`'s configuration: each reachable step shape
    (`ModelRunner.all_shapes`), largest first (the longest compiles start first), and with LoRA adapter slots each
    shape's program for steps with an adapter's token; with overlapped steps the widening of each sampled-row count;
    then, for each sampled-row count, the sampler's common token programs (`sampling.variant_keys`) and its logprob
    program. Penalty, bias and grammar-mask token programs compile on first use. For a runner built for a
    compile-only device (`ModelRunner(compile_for=...)`), every program is lowered for that device."""
    from netra_jax.engine.runner import step_key, widen_key

    shapes = sorted(runner.all_shapes(), key=lambda s: (-s.num_tokens, -s.prompt_rows))
    rows = sorted({s.num_rows for s in shapes})
    out = []
    for s in shapes:
        out.append(Variant("step", step_label(s), partial(runner.lower_step, s), step_key(s, False)))
        if runner.lora is not None:
            lower = partial(runner.lower_step, s, lora=True)
            out.append(Variant("step", step_label(s) + ", LoRA", lower, step_key(s, True)))
    if runner.overlap:
        out += [Variant("widen", _count(r, "row"), partial(runner.lower_widen, r), widen_key(r)) for r in rows]
    keys = sampling.variant_keys() if keys is None else keys
    dev = runner.compile_for
    lkey = sampling.logprob_key(sampling.SamplingKey(False, 0, 0, True))
    for r in rows:
        for k in keys:
            lower = partial(_lower_sampler, r, vocab_size, k, dev)
            out.append(Variant("sampler", sampler_label(r, k), lower, sampling.token_program_key(r, k)))
        lower = partial(_lower_logprobs, r, vocab_size, lkey, dev)
        out.append(Variant("logprobs", _count(r, "row"), lower, sampling.logprob_program_key(r, lkey)))
    return out


def default_workers() -> int:
    """Compile threads: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def compile_variants(
    variants: Sequence[Variant],
    *,
    workers: int | None = None,
    progress: Progress | None = None,
    on_compiled: Callable[[Variant, jax.stages.Compiled, float], None] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> WarmupReport:
    """Trace and lower each variant in this thread (tracing holds the GIL) and compile it in a pool of `workers`
    threads as soon as it is lowered, so lowering the next one overlaps the compiles; returns once all are compiled
    (the first compile error is raised). Each compiled program lands in its jit's caches and, when configured, in
    jax's persistent compilation cache. `progress` gets one line per variant ("compiling step variant 3 of 16
    (...)") as its compile starts; by default they are logged at INFO. `on_compiled(variant, compiled, seconds)` is
    called in the compiling thread once each is compiled (a bundle writer serializes it there); `compiler_options`:
    XLA options for every compile (a compile-only GPU device's, `engine.aot`)."""
    t0 = time.perf_counter()
    workers = workers or default_workers()
    say = progress or log.info
    totals = Counter(v.kind for v in variants)
    seen: Counter[str] = Counter()
    report = WarmupReport([], workers)
    futures: list[Future] = []
    # jax.default_device is per thread: the compile threads use the caller's (a compile-only GPU device's Pallas
    # lowering and CUDA libraries look for it there).
    device = jax.config.jax_default_device

    def compile_one(v: Variant, lowered: jax.stages.Lowered) -> None:
        t = time.perf_counter()
        with jax.default_device(device):
            compiled = lowered.compile(compiler_options)
        if on_compiled is not None:
            on_compiled(v, compiled, time.perf_counter() - t)

    with ThreadPoolExecutor(workers, thread_name_prefix="netra-compile") as pool:
        try:
            for v in variants:
                t = time.perf_counter()
                lowered = v.lower()
                report.lower_s += time.perf_counter() - t
                seen[v.kind] += 1
                say(f"compiling {v.kind} variant {seen[v.kind]} of {totals[v.kind]} ({v.label})")
                report.compiled.append((v.kind, v.label))
                futures.append(pool.submit(compile_one, v, lowered))
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
    widenings and sampler variants (`engine_variants`, through `compile_variants`) but those loaded compiled already
    (`ModelRunner.programs`, from a bundle), then the speculative `proposer`'s own programs; with an `embedder` (task
    "embed"): its embedding buckets instead."""
    t0 = time.perf_counter()
    if embedder is not None:
        embedder.warmup()
        report = WarmupReport([], 1)
    else:
        variants = [v for v in engine_variants(runner, vocab_size) if v.key not in runner.programs]
        report = compile_variants(variants, workers=workers, progress=progress)
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
