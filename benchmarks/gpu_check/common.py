"""What every section shares: the section context (time budget, results written after each row, the results of the
sections before), timing helpers, and the sizes of the full run and of the CPU dry run in one place."""

from __future__ import annotations

import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVER_PID = "serve.pid"  # in the work directory while the serve section's server runs


@dataclass(frozen=True)
class Sweep:
    """One serving sweep: closed-loop passes of `netra-jax bench serve` (random prompts, ignore_eos), one per user
    count, each ended after `max_s` seconds (the requests still streaming are cut and counted as far as they got)."""

    name: str  # "short" | "long"
    input_len: int
    output_len: int
    users: tuple[int, ...]
    max_s: float

    def prompts(self, users: int) -> int:
        """Requests per pass: one and a half rounds of `users` (at hundreds of users `max_s` ends the pass before the
        first round is done; each prompt costs the client a /detokenize and a /tokenize call before the pass)."""
        return max(users * 3 // 2, 3)


@dataclass(frozen=True)
class Sizes:
    """Shapes of the attention benchmarks and of the Llama-shaped model, for the device run or the dry run."""

    heads: int  # query heads
    kv_heads: int
    head_dim: int
    page_size: int
    decode_grid: tuple[tuple[int, int], ...]  # (batch, context) decode points
    mixed_steps: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (name, ((cached, new) per sequence))
    profile_users: tuple[int, ...]  # LLM.generate batches traced by jax.profiler (steady decode)
    profile_tokens: int  # output tokens of each traced generate
    prompt_len: int
    output_len: int
    serve_sweeps: tuple[Sweep, ...]
    hf_batches: tuple[int, ...]


FULL = Sizes(
    heads=32,
    kv_heads=8,
    head_dim=128,
    page_size=16,
    # batch x context, at most 8 GiB of bf16 K/V (b * ctx * 4 KiB); ordered so the most telling points come first
    # (64 users at 8192 tokens: the serving goal's point)
    decode_grid=((64, 8192), (1, 8192), (256, 1024), (16, 32768), (256, 4096), (64, 32768), (1, 32768), (16, 1024)),
    mixed_steps=(
        ("prefill_4x512", ((0, 512),) * 4),
        ("chunk1024+63dec_ctx4k", ((3072, 1024),) + ((4095, 1),) * 63),
    ),
    profile_users=(1, 256),
    profile_tokens=48,
    prompt_len=128,
    output_len=128,
    serve_sweeps=(
        Sweep("short", 1024, 256, (1, 16, 64, 128, 256, 512), 18.0),
        Sweep("long", 8192, 256, (1, 16, 64, 128), 22.0),
    ),
    hf_batches=(1, 64),
)

DRY = Sizes(
    heads=4,
    kv_heads=2,
    head_dim=64,
    page_size=16,
    decode_grid=((2, 48),),
    mixed_steps=(("prefill+decode", ((0, 9), (30, 1))),),
    profile_users=(1, 4),
    profile_tokens=8,
    prompt_len=8,
    output_len=8,
    serve_sweeps=(Sweep("short", 8, 8, (1, 4), 10.0), Sweep("long", 32, 8, (1, 2), 10.0)),
    hf_batches=(1, 2),
)


def sizes(dry: bool) -> Sizes:
    return DRY if dry else FULL


@dataclass
class Section:
    """One section's run: `data` is saved to `part` after every `add`, so a section killed at its deadline keeps
    what it measured; `prior` holds the merged results of the sections that ran before it."""

    name: str
    dry: bool
    deadline: float  # time.time() after which no new measurement starts
    part: Path
    work: Path  # scratch directory shared by the sections (model directory, XLA cache)
    prior: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def sizes(self) -> Sizes:
        return sizes(self.dry)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        tmp = self.part.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(self.part)

    def add(self, key: str, row: dict) -> dict:
        """Append a row to the list `key`, print it and save."""
        self.data.setdefault(key, []).append(row)
        print(f"[{self.name}] {key}: {json.dumps(row, default=_jsonable)}", flush=True)
        self.save()
        return row

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        print(f"[{self.name}] {key}: {json.dumps(value, default=_jsonable)}", flush=True)
        self.save()

    def skip(self, key: str, what: dict, reason: str) -> None:
        """Record work not done (time budget, missing backend, unsupported shape) with the reason."""
        self.add(key, {**what, "skipped": reason})

    def attempt(self, key: str, what: dict, fn: Callable[[], dict], need_s: float = 0.0) -> dict | None:
        """Run one measurement: skipped when fewer than `need_s` seconds are left, its exception recorded as the row's
        error (the section goes on with the next one)."""
        if self.left() < need_s:
            self.skip(key, what, f"time budget ({self.left():.0f}s left, needs about {need_s:.0f}s)")
            return None
        try:
            return self.add(key, {**what, **fn()})
        except Exception as e:  # one failed shape or backend is a result, not the end of the section
            self.add(key, {**what, "error": f"{type(e).__name__}: {str(e)[:600]}"})
            traceback.print_exc()
            return None

    def copy_gbps(self) -> float | None:
        return (self.prior.get("device") or {}).get("copy_gbps")

    def target(self) -> str | None:
        """The target description (`netra_jax.targets`: "h100", "h200", ...) of the GPU the `device` section found;
        None in the dry run and for a GPU the targets do not describe (the engine then sizes itself)."""
        from netra_jax.targets import gpu_target_of

        kind = ((self.prior.get("device") or {}).get("env") or {}).get("device_kind")
        return None if self.dry or not kind else gpu_target_of(kind)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def fmt(v: Any) -> str:
    """A table cell: "-" for None, 3 significant digits below 1000, whole numbers above."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def why(row: dict) -> str:
    """A table cell for a row measured nothing: why (skipped or failed), else "-"."""
    if "skipped" in row:
        return "skipped: " + row["skipped"][:60]
    if "error" in row:
        return "error: " + row["error"][:60]
    return "-"


def sig(x: float | None, digits: int = 4) -> float | None:
    """x rounded to `digits` significant digits (None and non-finite values pass as None)."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def decode_rate(first: Callable[[int], float], full: Callable[[int], float], n: int, reps: int = 2) -> dict:
    """Batch-1 decode speed without the prompt: (n - 1) tokens over the time between generating 1 token and n
    tokens (first(i), full(i): seconds of one such generate on fresh prompt i), the fastest of `reps` each."""
    t1 = min(first(i) for i in range(reps))
    tn = min(full(reps + i) for i in range(reps))
    if tn <= t1:
        raise ValueError(f"{n} tokens took no longer than 1 ({tn:.4f}s vs {t1:.4f}s): below the timing noise")
    return {"first_token_s": sig(t1), "decode_tok_s": sig((n - 1) / (tn - t1))}


def median_time(call: Callable[[int], Any], sync: Callable[[Any], Any], *, reps: int = 5, inner: int = 10) -> float:
    """Seconds per call: the median over `reps` of the mean of `inner` back-to-back calls (call(i) may rotate inputs
    so repeated calls do not hit the cache), synchronising once per repetition; one warm-up call first. A call slower
    than 0.2 s (the interpreters of the dry run) is timed once more only."""
    sync(call(0))
    t = time.perf_counter()
    sync(call(1))
    if time.perf_counter() - t > 0.2:
        reps, inner = 1, 1
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        out = None
        for i in range(inner):
            out = call(r * inner + i)
        sync(out)
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)
