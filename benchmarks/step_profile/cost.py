"""What one engine step costs on this machine, by composition: D decodes at a context length plus prompt chunks, each
padded to its token bucket, run through ModelRunner.run on the default model in float32 (no scheduler, no server).

Usage: `.venv/bin/python -m benchmarks.step_profile cost [CASE ...] [--repeats 7] [--no-attention] [--xla-only]
[--model PATH] [--out FILE]`
A CASE is JSON `[decodes, context, [chunk, ...]]`, e.g. `[8,200,[120]]`: 8 decode tokens at position 200 and one
120-token prompt chunk (bucket 128). Without cases, a grid of decode-only, prefill-only and mixed steps around the
8- and 32-user serving loads. Times: the minimum over interleaved repeats, as wall time and as the process's CPU
time (all threads; steadier than wall time on a shared machine, though contention inflates it too).
--no-attention: each case also runs through a second runner whose attention is the identity (the projections, MLPs,
lm_head and sampling rows alone), interleaved with the real one: their difference is the attention's cost.
--xla-only: each case also runs without the C++ CPU kernels (XLA's dot for every matmul, the jnp attention).
Writes benchmarks/results/<date>-step_cost.json (with the machine) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

from benchmarks.step_profile import common

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
    return common.time_call(lambda: runner.run(out).logits)


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=7, model_help="a checkpoint (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("cases", nargs="*", type=json.loads, help="[decodes, context, [chunk, ...]] (default: a grid)")
    p.add_argument("--no-attention", action="store_true", help="also time each case with attention stubbed out")
    p.add_argument(
        "--xla-only",
        action="store_true",
        help="also time each case without the C++ CPU kernels: XLA's dot for every matmul and the jnp attention",
    )


def run(a: argparse.Namespace) -> int:
    import random

    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import EngineConfig

    record = common.Run("step_cost")
    model = {"model": a.model} if a.model else {}
    engine = build_engine(EngineConfig(**model, dtype="float32", warmup=False))  # overlapped steps, as served
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
    for rep in range(a.repeats):
        for i, out in enumerate(steps):
            for k in common.alternating(runners, rep):
                times[(i, k)].append(time_run(runners[k], out))
    rows = []
    for i, (case, out) in enumerate(zip(cases, steps, strict=True)):
        row = {
            "case": case,
            "tokens": out.num_batched_tokens,
            "bucket": engine.runner.shape_for(out.num_batched_tokens).num_tokens,
        }
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
    doc = record.record(
        model=f"{common.model_label(a.model)}, float32",
        matmul_backend=engine.runner.matmul_backend,
        attention_backend=engine.runner.backend,
        repeats=a.repeats,
        rows=rows,
    )
    record.write(doc, a.out)
    return 0
