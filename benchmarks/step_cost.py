"""What one engine step costs on this machine, by composition: D decodes at a context length plus prompt chunks, each
padded to its token bucket, run through ModelRunner.run on the default model in float32 (no scheduler, no server).

Usage: `.venv/bin/python benchmarks/step_cost.py [CASE ...] [--repeats 7] [--no-attention] [--out FILE]`
A CASE is JSON `[decodes, context, [chunk, ...]]`, e.g. `[8,200,[120]]`: 8 decode tokens at position 200 and one
120-token prompt chunk (bucket 128). Without cases, a grid of decode-only, prefill-only and mixed steps around the
8- and 32-user serving loads. Times: the minimum over interleaved repeats, as wall time and as the process's CPU
time (all threads; steadier than wall time on a shared machine, though contention inflates it too).
--no-attention: each case also runs through a second runner whose attention is the identity (the projections, MLPs,
lm_head and sampling rows alone), interleaved with the real one: their difference is the attention's cost.
Writes benchmarks/results/<date>-step_cost.json (with the machine) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRID = [
    [1, 200, []],
    [8, 200, []],
    [8, 16, []],
    [32, 200, []],
    [32, 16, []],
    [0, 0, [128]],
    [0, 0, [128] * 4],
    [0, 0, [128] * 8],
    [0, 0, [128] * 16],
    [8, 200, [120]],
    [8, 200, [128]],
    [32, 200, [96]],
    [32, 200, [128]],
    [31, 200, [33]],
]


def build_step(pool, rng, counter, decodes: int, context: int, chunks: list[int]):
    """A SchedulerOutput of `decodes` one-token decodes at position `context` and prompt chunks from position 0,
    on freshly allocated blocks (freed again: only their ids matter to the step)."""
    from netra_jax.engine.request import Request
    from netra_jax.engine.sched_output import ScheduledRequest, SchedulerOutput

    out, reqs = SchedulerOutput(), []
    for start, n in [(context, 1)] * decodes + [(0, c) for c in chunks]:
        r = Request(f"s{next(counter)}", [rng.randrange(1000) for _ in range(start + n)])
        r.block_ids = pool.allocate(pool.blocks_needed(start + n))
        reqs.append(r)
        out.scheduled.append(ScheduledRequest(r, n, start, list(r.block_ids), True))
    out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
    for r in reqs:
        pool.free(r.block_ids)
    return out


def time_run(runner, out) -> tuple[float, float]:
    """(wall s, process CPU s) of one dispatched step until its logits are ready."""
    import jax

    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(runner.run(out).logits)
    return time.perf_counter() - t0, time.process_time() - c0


def second_runner(engine, **overrides):
    """Another runner over the engine's parameters and options, with `overrides` of ModelRunner's arguments."""
    from netra_jax.engine.runner import ModelRunner

    r = engine.runner
    sched = engine.scheduler.config
    kw = dict(
        num_pages=r.num_pages,
        page_size=r.page_size,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        overlap=r.overlap,
        backend=r.backend,
        matmul_backend=r.matmul_backend,
    )
    return ModelRunner(engine.model_config, r.params, **{**kw, **overrides})


def identity_attention_runner(engine):
    """A second runner over the same parameters whose attention returns its queries (traced after the patch; the
    patch is undone before returning, and the engine's own runner was traced before it)."""
    import netra_jax.models.transformer as transformer

    real = transformer.attention

    def patch(attention):
        transformer.attention = attention
        transformer._layer.clear_cache()  # the layer is a jit of its own: retrace it with the patched attention

    patch(lambda q, *args, **kwargs: q)
    return second_runner(engine), lambda: patch(real)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", type=json.loads, help="[decodes, context, [chunk, ...]] (default: a grid)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-attention", action="store_true", help="also time each case with attention stubbed out")
    ap.add_argument(
        "--xla-only",
        action="store_true",
        help="also time each case without the C++ CPU kernels: XLA's dot for every matmul and the jnp attention",
    )
    ap.add_argument("--model", default=None, help="a checkpoint (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import random

    from netra_jax.bench.machine import machine_info
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import EngineConfig

    load0 = os.getloadavg()
    model = {"model": a.model} if a.model else {}
    engine = build_engine(
        EngineConfig(**model, dtype="float32", warmup=False)
    )  # overlapped steps, as the server runs them
    rng, counter = random.Random(0), itertools.count()
    cases = a.cases or GRID
    steps = [build_step(engine.pool, rng, counter, d, ctx, chunks) for d, ctx, chunks in cases]
    runners = {"full": engine.runner}
    for out in steps:  # compile each bucket (traced before any patch)
        time_run(engine.runner, out)
    if a.no_attention:
        stub, restore = identity_attention_runner(engine)
        try:
            for out in steps:
                time_run(stub, out)
        finally:
            restore()
        runners["no_attention"] = stub
    if a.xla_only:
        runners["xla_only"] = second_runner(engine, matmul_backend="xla", backend="reference")
        for out in steps:
            time_run(runners["xla_only"], out)
    times = {(i, k): [] for i in range(len(steps)) for k in runners}
    for rep in range(a.repeats):  # interleaved, the runners in alternating order
        for i, out in enumerate(steps):
            for k in list(runners) if rep % 2 == 0 else list(runners)[::-1]:
                times[(i, k)].append(time_run(runners[k], out))
    rows = []
    for i, (case, out) in enumerate(zip(cases, steps, strict=True)):
        row = {
            "case": case,
            "tokens": out.num_batched_tokens,
            "bucket": engine.runner.shape_for(out.num_batched_tokens),
        }
        row["bucket"] = row["bucket"].num_tokens
        for k in runners:
            row[f"{k}_wall_ms"] = 1e3 * min(w for w, _ in times[(i, k)])
            row[f"{k}_cpu_ms"] = 1e3 * min(c for _, c in times[(i, k)])
        rows.append(row)
        extra = ""
        if a.no_attention:
            extra = f"  no-attention wall {row['no_attention_wall_ms']:7.1f} CPU {row['no_attention_cpu_ms']:7.1f}"
        if a.xla_only:
            extra += f"  XLA-only wall {row['xla_only_wall_ms']:7.1f}"
        print(
            f"{json.dumps(case):32s} tokens {row['tokens']:5d} bucket {row['bucket']:5d}  "
            f"wall {row['full_wall_ms']:7.1f}  CPU {row['full_cpu_ms']:7.1f} ms  "
            f"CPU/bucket token {row['full_cpu_ms'] / row['bucket']:5.2f}{extra}",
            flush=True,
        )
    doc = {
        "benchmark": "step_cost",
        "date": datetime.date.today().isoformat(),
        "model": f"{a.model or 'SmolLM2-135M-Instruct (default)'}, float32",
        "matmul_backend": engine.runner.matmul_backend,
        "attention_backend": engine.runner.backend,
        "machine": machine_info(),
        "load_average_before_after": [load0, os.getloadavg()],
        "repeats": a.repeats,
        "rows": rows,
    }
    from netra_jax.bench.results import write_result

    write_result(doc, "step_cost", HERE / "results", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
