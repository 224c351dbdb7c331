"""Warm-up: every program the engine's configuration can reach (step buckets, the widening of sampled ids, sampler
variants, the LoRA slot write) traced and lowered in turn and compiled in parallel threads (XLA releases the GIL),
with progress. The programs the first requests need (`ready_shapes`) come first: a server answers once they are
compiled and compiles the rest in the background (`BackgroundCompile`), its steps padded up into what is compiled."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import jax

from netra_jax.engine.step_layout import BatchShape
from netra_jax.ops import sampling

if TYPE_CHECKING:
    from netra_jax.engine.program_store import ProgramStore
    from netra_jax.engine.runner import ModelRunner

__all__ = [
    "BACKGROUND_GATE_ENV",
    "COMPILE_THREADS",
    "GATE_ENV",
    "READY_DECODE_TOKENS",
    "READY_PREFILL_TOKENS",
    "BackgroundCompile",
    "StepLimits",
    "Variant",
    "WarmupReport",
    "compile_variants",
    "default_workers",
    "engine_variants",
    "ready_shapes",
    "sampler_label",
    "step_limits",
    "usable_steps",
    "step_label",
    "warm_up",
]

log = logging.getLogger(__name__)

COMPILE_THREADS = "netra-compile"  # the name prefix of the compile threads (compilations outside them: elsewhere)
GATE_ENV = "NETRA_JAX_WARMUP_GATE"  # a file path: warm-up ends only once it exists (holds a server in warm-up)
# a file path: a background compile starts only once it exists (holds a ready server on its ready programs)
BACKGROUND_GATE_ENV = "NETRA_JAX_BACKGROUND_GATE"
Progress = Callable[[str], None]


# The step buckets compiled before a server answers (`ready_shapes`), chosen from `benchmarks/program_costs.py`
# (SmolLM2-135M on a 2-core EPYC, results/2026-12-07-program_costs.json): a step program takes 2.0-3.9 s to compile
# and 0.5-1.3 s to load from a cache, whatever its bucket, while a CPU step costs about in proportion to its tokens
# (decode of 1 / 8 / 64 sequences 14 / 28 / 158 ms, prefill of 256 / 512 / 2048 tokens 0.50 / 1.03 / 5.5 s). So the
# ready set is two buckets: one holding every running sequence's decode (at most 64 tokens: 64 sequences pad into it
# at no cost, a lone one at 11x its own bucket's until that compiles) and one of 256 tokens for prompts (chunked to it
# meanwhile); both sample 64 rows, so one set of sampler programs serves them. Requests for prompt logprobs wait in
# the queue for their own bucket, the first to compile after the ready set; the other buckets follow, small decode
# buckets first.
READY_DECODE_TOKENS = 64
READY_PREFILL_TOKENS = 256


@dataclass(frozen=True)
class Variant:
    """One compiled program the engine calls: `lower` traces and lowers it with the arguments the engine passes, so
    compiling the result gives the executable the engine runs (`ModelRunner.programs` under `key`)."""

    kind: str  # "step" | "widen" | "sampler" | "logprobs" | "lora"
    label: str  # what makes it a variant, for progress lines: "128 tokens, 64 rows"
    lower: Callable[[], jax.stages.Lowered] = field(compare=False, repr=False)
    # the program's key in the table its call site reads compiled programs from (`ModelRunner.programs`): the runner's
    # `step_key` / `widen_key` / `LORA_SLOT_KEY`, the sampler's `token_program_key` / `logprob_program_key`
    key: tuple = ()
    # a step's: the keys of the other programs its steps run (its rows' sampler programs and widening), without
    # which a step cannot use it
    needs: tuple[tuple, ...] = ()
    ready: bool = False  # compiled before a server answers (`ready_shapes` and what they need)


@dataclass
class WarmupReport:
    """What a warm-up compiled, in the order compiles were started, and where its seconds went."""

    compiled: list[tuple[str, str]]  # (kind, label) of each variant
    workers: int
    lower_s: float = 0.0  # tracing and lowering (Python, one thread)
    seconds: float = 0.0  # wall time of the whole warm-up
    background: BackgroundCompile | None = None  # the rest, compiling after the engine is ready

    @property
    def pending(self) -> int:
        """Programs still compiling in the background."""
        return 0 if self.background is None else self.background.pending


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
    kind = "covering" if key == sampling.COVER_KEY else "greedy" if key.all_greedy else "sampled"
    return f"{_count(num_rows, 'row')}, {kind}"


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


def ready_shapes(runner: ModelRunner) -> list[BatchShape]:
    """The step shapes a server compiles before it answers (see READY_DECODE_TOKENS): a decode bucket holding every
    running sequence (up to READY_DECODE_TOKENS) and a prompt bucket of READY_PREFILL_TOKENS (each capped at the
    largest step)."""
    top = runner.max_step_tokens
    decode = runner.shape_for(min(runner.max_seqs_bucket, READY_DECODE_TOKENS, top))
    return list(dict.fromkeys([decode, runner.shape_for(min(READY_PREFILL_TOKENS, top))]))


def _step_order(runner: ModelRunner) -> list[BatchShape]:
    """Every reachable step shape in the order to compile them: the ready ones; the prompt-logprob bucket of the
    ready prompt size (requests for prompt logprobs wait for it); decode buckets from the smallest up (a lone
    sequence stops padding); the largest plain and prompt-logprob buckets (long prompts stop being chunked); then the
    rest from the largest down (the longest compiles first)."""
    shapes = runner.all_shapes()
    ready = ready_shapes(runner)
    plp = runner.shape_for(min(READY_PREFILL_TOKENS, runner.max_step_tokens), True)
    decode = [s for s in shapes if not s.prompt_rows and s.num_tokens < ready[0].num_tokens]
    top = [max((s for s in shapes if bool(s.prompt_rows) == p), key=lambda s: s.num_tokens) for p in (0, 1)]
    rest = sorted(shapes, key=lambda s: (-s.num_tokens, -s.prompt_rows))
    return list(dict.fromkeys([*ready, plp, *decode, *top, *rest]))


def engine_variants(
    runner: ModelRunner, vocab_size: int, keys: Sequence[sampling.SamplingKey] | None = None
) -> list[Variant]:
    """Every program the engine may call for `runner`'s configuration, in the order to compile them (`_step_order`),
    each step preceded by the programs its rows need first: the widening of its sampled rows (overlapped steps), the
    sampler's token programs (`sampling.variant_keys`: greedy, sampled, and the covering one that serves bias,
    penalty and grammar-mask batches) and their logprob programs; with LoRA adapter slots, the slot write first and
    each shape's program for steps with an adapter's token beside its plain one. The ready ones (`ready_shapes`
    and what they need) are marked `ready`. For a runner built for a compile-only device
    (`ModelRunner(compile_for=...)`), every program is lowered for that device."""
    from netra_jax.engine.runner import LORA_SLOT_KEY, step_key, widen_key

    keys = sampling.variant_keys() if keys is None else keys
    lkeys = sampling.logprob_keys(keys)
    dev = runner.compile_for
    ready = ready_shapes(runner)
    out: list[Variant] = []
    if runner.lora is not None:
        out.append(Variant("lora", "adapter slot write", runner.lower_lora_slot, LORA_SLOT_KEY, ready=True))
    emitted: set[int] = set()
    for s in _step_order(runner):
        r, is_ready = s.num_rows, s in ready
        row_programs = []
        if runner.overlap:
            row_programs.append(Variant("widen", _count(r, "row"), partial(runner.lower_widen, r), widen_key(r)))
        for k in keys:
            lower = partial(_lower_sampler, r, vocab_size, k, dev)
            row_programs.append(Variant("sampler", sampler_label(r, k), lower, sampling.token_program_key(r, k)))
        for lk in lkeys:
            lower = partial(_lower_logprobs, r, vocab_size, lk, dev)
            label = _count(r, "row") + ("" if lk == sampling.logprob_key(keys[0]) else ", covering")
            row_programs.append(Variant("logprobs", label, lower, sampling.logprob_program_key(r, lk)))
        if r not in emitted:
            emitted.add(r)
            out += [dataclasses.replace(v, ready=is_ready) for v in row_programs]
        needs = tuple(v.key for v in row_programs)
        for lora in (False, True) if runner.lora is not None else (False,):
            label = step_label(s) + (", LoRA" if lora else "")
            lower = partial(runner.lower_step, s, lora=lora)
            # of the adapters' steps only the decode bucket's is ready: it holds a short prompt too, and longer
            # ones are chunked to it until the adapters' prompt bucket compiles, the first after /ready
            ready_now = is_ready and (not lora or s == ready[0])
            out.append(Variant("step", label, lower, step_key(s, lora), needs, ready_now))
    return out


def usable_steps(variants: Sequence[Variant], programs: Mapping[tuple, Any]) -> frozenset[tuple]:
    """The step keys whose program and the programs it needs are all in `programs`."""
    return frozenset(
        v.key for v in variants if v.kind == "step" and v.key in programs and all(n in programs for n in v.needs)
    )


@dataclass(frozen=True)
class StepLimits:
    """What a partly compiled engine can run (`step_limits`): steps of at most `max_tokens` tokens, and no new
    request of the `held` kinds, (prompt logprobs, adapter) pairs with no usable step program yet."""

    max_tokens: int | None
    held: frozenset[tuple[bool, bool]] = frozenset()


def step_limits(variants: Sequence[Variant], usable: frozenset[tuple]) -> StepLimits:
    """The limits that keep a partly compiled engine on its `usable` steps: a step may hold the largest number of
    tokens every kind of step (plain and with prompt logprobs; with and without an adapter) with a usable program
    has one for, and requests of the kinds with none wait."""
    largest: dict[tuple, int] = {}
    for v in variants:
        if v.kind == "step":
            _, shape, lora = v.key
            kind = (bool(shape.prompt_rows), lora)
            size = shape.num_tokens if v.key in usable else 0
            largest[kind] = max(largest.get(kind, 0), size)
    runnable = [n for n in largest.values() if n]
    held = frozenset(k for k, n in largest.items() if not n)
    return StepLimits(min(runnable) if runnable else None, held)


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
    quiet: bool = False,
    before_each: Callable[[], None] | None = None,
    nice: int = 0,
    store: ProgramStore | None = None,
) -> WarmupReport:
    """Trace and lower each variant in this thread (tracing holds the GIL) and compile it in a pool of `workers`
    threads as soon as it is lowered, so lowering the next one overlaps the compiles; returns once all are compiled
    (the first compile error is raised). Each compiled program lands in its jit's caches and, when configured, in
    jax's persistent compilation cache. `progress` gets one line per variant ("compiling step variant 3 of 16
    (...)") as its compile starts; by default they are logged at INFO. `on_compiled(variant, compiled, seconds)` is
    called in the compiling thread once each is compiled (a bundle writer serializes it there); `compiler_options`:
    XLA options for every compile (a compile-only GPU device's, `engine.aot`). quiet: no line per variant, one per
    step program and its count left ("compiling in the background: step variant (...); 12 more after it").
    `before_each()` is called before each variant is lowered; `nice`: the compile threads' scheduling niceness
    (Linux; a background compile leaves the CPUs to the engine). With a `store` (`program_store.ProgramStore`), the
    variants it holds are loaded from it in the pool, neither traced nor lowered ("loading ..." lines), and each
    one compiled here is written to it (not one read back from jax's persistent cache)."""
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
        _CACHE_HIT.hit = False
        with jax.default_device(device):
            compiled = lowered.compile(compiler_options)
        if store is not None and not _CACHE_HIT.hit:
            store.save(v.key, compiled)
        if on_compiled is not None:
            on_compiled(v, compiled, time.perf_counter() - t)

    def load_one(v: Variant) -> bool:
        """Load `v` from the store; False when it could not (it is compiled instead)."""
        t = time.perf_counter()
        compiled = store.load(v.key)
        if compiled is None:
            return False
        if on_compiled is not None:
            on_compiled(v, compiled, time.perf_counter() - t)
        return True

    def start(v: Variant, verb: str) -> None:
        seen[v.kind] += 1
        if not quiet:
            say(f"{verb} {v.kind} variant {seen[v.kind]} of {totals[v.kind]} ({v.label})")
        elif v.kind == "step":
            left = len(variants) - len(report.compiled) - 1
            say(f"{verb} in the background: step variant ({v.label}); {left} more after it")
        report.compiled.append((v.kind, v.label))

    def lower_and_compile(v: Variant, announce: bool = True) -> None:
        if before_each is not None:
            before_each()
        t = time.perf_counter()
        lowered = v.lower()
        report.lower_s += time.perf_counter() - t
        if announce:
            start(v, "compiling")
        futures.append(pool.submit(compile_one, v, lowered))

    if store is not None:
        _watch_cache_hits()
    stored = [v for v in variants if store is not None and store.has(v.key)]
    stored_ids = {id(v) for v in stored}
    with ThreadPoolExecutor(workers, COMPILE_THREADS, initializer=_renice, initargs=(nice,)) as pool:
        try:
            loads = []
            for v in stored:  # no tracing: straight to the pool
                start(v, "loading")
                loads.append((v, pool.submit(load_one, v)))
            for v in variants:
                if id(v) not in stored_ids:
                    lower_and_compile(v)
            for v, f in loads:
                if not f.result():  # unreadable: compiled after all
                    lower_and_compile(v, announce=False)
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    report.seconds = time.perf_counter() - t0
    return report


_CACHE_HIT = threading.local()  # per compile thread: whether its last compile was read from jax's persistent cache
_CACHE_HITS_EVENT = "/jax/compilation_cache/cache_hits"


@functools.cache
def _watch_cache_hits() -> None:
    """Note jax's persistent-cache hits per thread (an executable read back from it is not stored again)."""

    def on_event(event: str, **kwargs) -> None:
        if event == _CACHE_HITS_EVENT:
            _CACHE_HIT.hit = True

    jax.monitoring.register_event_listener(on_event)


def _renice(nice: int) -> None:
    """Lower this thread's scheduling priority by `nice` (Linux schedules threads as tasks; elsewhere nothing)."""
    if nice and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


class _Stopped(Exception):
    """A background compile was told to stop (`BackgroundCompile.stop`)."""


YIELD_S = 1.0  # the longest a background compile waits for the engine to go idle before lowering its next program


class BackgroundCompile:
    """Compiles the variants a server does not wait for, in a thread of its own after it answers (`workers` compile
    threads, default half the CPUs: the engine keeps the rest). Each program joins `runner.programs` as it is
    compiled; `runner.usable` and `on_change(step limits)` follow as steps become usable, and once all are
    compiled the restriction ends (`install` is `warm_up`'s, which does both). It stays out of the requests' way: its
    threads run at a lower priority (niceness 10), and while `busy()` (requests in the engine) it waits up to
    YIELD_S before lowering each program (lowering holds the GIL), so a lone request runs without it and steady
    traffic still lets it finish. A failed compile is logged and kept in `error`, and `give_up()` lifts the
    restriction: the engine goes on with the programs it has and compiles others on first use."""

    def __init__(
        self,
        variants: Sequence[Variant],
        install: Callable[[Variant, jax.stages.Compiled, float], None],
        *,
        workers: int | None = None,
        progress: Progress | None = None,
        busy: Callable[[], bool] | None = None,
        store: ProgramStore | None = None,
        give_up: Callable[[], None] | None = None,
    ) -> None:
        self.variants = list(variants)
        self._give_up = give_up
        self._busy = busy
        self._store = store
        self.total = len(self.variants)
        self.compiled = 0
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._install = install
        self._workers = workers or max(1, default_workers() // 2)
        self._say = progress or log.info
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netra-background-compile", daemon=True)

    @property
    def pending(self) -> int:
        """Programs not compiled yet."""
        return self.total - self.compiled

    def start(self) -> BackgroundCompile:
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every program is compiled (or a compile failed); False on timeout."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _on_compiled(self, v: Variant, compiled: jax.stages.Compiled, seconds: float) -> None:
        self._install(v, compiled, seconds)
        self.compiled += 1

    def stop(self, timeout: float | None = None) -> bool:
        """Compile nothing more (the programs compiling now finish) and wait for the thread, up to `timeout`; a
        server stopping calls it, so no compile runs on while the process exits. False on timeout."""
        self._stop.set()
        return self.wait(timeout)

    def _yield(self) -> None:
        """Wait while the engine is busy, up to YIELD_S; _Stopped once `stop` was called."""
        deadline = time.monotonic() + YIELD_S
        while self._busy is not None and self._busy() and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.01)
        if self._stop.is_set():
            raise _Stopped

    def _run(self) -> None:
        _wait_for_gate(self._say, BACKGROUND_GATE_ENV, "background compile held", self._stop)
        _renice(10)
        t0 = time.perf_counter()
        try:
            compile_variants(
                self.variants,
                workers=self._workers,
                progress=self._say,
                on_compiled=self._on_compiled,
                quiet=True,
                before_each=self._yield,
                nice=10,
                store=self._store,
            )
            self.seconds = time.perf_counter() - t0
            self._say(f"background compile done: {self.total} programs in {self.seconds:.1f}s")
        except _Stopped:
            self._say(f"background compile stopped with {self.pending} programs left")
        except BaseException as e:  # noqa: BLE001 (kept and logged: the engine serves with what it has)
            self.error = e
            log.error("background compile failed after %d of %d programs: %r", self.compiled, self.total, e)
            if self._give_up is not None:  # no request waits for a program that will not come
                self._give_up()
        finally:
            self._done.set()


def warm_up(
    runner: ModelRunner,
    vocab_size: int,
    *,
    embedder=None,
    proposer=None,
    progress: Progress | None = None,
    workers: int | None = None,
    background: bool = False,
    on_change: Callable[[StepLimits | None], None] | None = None,
    busy: Callable[[], bool] | None = None,
    store: ProgramStore | None = None,
) -> WarmupReport:
    """Compile what an engine of these parts may call: the runner's variants (`engine_variants`, through
    `compile_variants`) but those loaded compiled already (`ModelRunner.programs`, from a bundle), then the
    speculative `proposer`'s own programs; with an `embedder` (task "embed"): its embedding buckets instead. Each
    program is installed in `runner.programs`, which the runner and sampler run. background: compile only the
    ready variants (and the proposer's) now and return with the rest compiling in a `BackgroundCompile`
    (`WarmupReport.background`); meanwhile steps run only in usable programs (`runner.usable`), and `on_change` gets
    the limits that keep them there (`step_limits`; None once all are compiled); `busy()`: whether requests are in
    the engine (the background compile makes way for them, see `BackgroundCompile`); `store`: programs kept
    between starts, loaded instead of compiled and written when compiled (`compile_variants`)."""
    t0 = time.perf_counter()
    say = progress or log.info
    report = WarmupReport([], 1)
    if embedder is not None:
        embedder.warmup()
    else:
        variants = engine_variants(runner, vocab_size)
        todo = [v for v in variants if v.key not in runner.programs]
        # steps first: they take longest to compile (or to load from a cache), so lowering the small programs after
        # them overlaps their compiles
        now = sorted([v for v in todo if v.ready] if background else todo, key=lambda v: v.kind != "step")
        later = [v for v in todo if not v.ready] if background else []
        lock = threading.Lock()

        def refresh() -> None:  # the steps usable with the programs installed so far, and the limits they set
            usable = usable_steps(variants, runner.programs)
            done = len(usable) == sum(v.kind == "step" for v in variants)
            runner.usable = None if done else usable
            if on_change is not None:
                on_change(None if done else step_limits(variants, usable))

        def install(v: Variant, compiled: jax.stages.Compiled, seconds: float) -> None:
            runner.programs[v.key] = compiled

        def install_and_refresh(v: Variant, compiled: jax.stages.Compiled, seconds: float) -> None:
            with lock:
                install(v, compiled, seconds)
                refresh()

        report = compile_variants(now, workers=workers, progress=say, on_compiled=install, store=store)
        refresh()  # nothing is served before this returns: the limits are set once the ready set is in
        if proposer is not None:
            say("compiling the speculative proposer's variants")
            proposer.warmup()
        if later:

            def give_up() -> None:
                with lock:
                    runner.usable = None
                    if on_change is not None:
                        on_change(None)

            background_compile = BackgroundCompile(
                later, install_and_refresh, progress=say, busy=busy, store=store, give_up=give_up
            )
            report.background = background_compile.start()
    _wait_for_gate(say)
    report.seconds = time.perf_counter() - t0
    return report


def _wait_for_gate(
    say: Progress, env: str = GATE_ENV, what: str = "warm-up compiled", stop: threading.Event | None = None
) -> None:
    """Hold here while $`env` names a file that does not exist yet (tests observe a server in warm-up, or ready
    on its ready programs alone, with it), or until `stop` is set."""
    gate = os.environ.get(env)
    if not gate or os.path.exists(gate):
        return
    say(f"{what}: waiting for {gate} to exist (${env})")
    event = stop or threading.Event()
    while not os.path.exists(gate) and not event.is_set():
        event.wait(0.05)
