"""Host time per engine step and how much of it overlapped (async) scheduling hides: greedy decode at batch 1 and
32 on the default model (SmolLM2-135M, float32), the same engine built with async_scheduling off and on.

Usage: `.venv/bin/python -m benchmarks.step_profile overlap [--model PATH] [--batches 1 32] [--max-tokens 64]
[--repeats 4] [--out FILE]`. Writes benchmarks/results/<date>-host_overlap.json and prints a table.

Per decode step (every step after a batch's first, prefill, step) it records the wall time of `LLMEngine.step()`
and the part of it the host spent blocked on the device's results (`LLMEngine.device_wait_s`); the rest is host
work (schedule, pack, sampling rows, bookkeeping, detokenize, outputs; `host_cpu_ms` is the CPU time of the
engine's thread, which on CPU also runs any XLA work dispatched inline). Synchronous, host work and device work
add up; overlapped, the host's work for step N runs while the device computes step N+1, so the step shrinks by
the hidden part: hidden = wall(sync) - wall(overlap), compared with the synchronous host time.
On CPU the "device" is XLA's CPU runtime, whose threads share the cores with the Python thread: overlap can only
hide host work where a core is idle, so the CPU figure is a lower bound of what a GPU gets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.offline_throughput import questions
from benchmarks.step_profile import common


def run_once(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """One generate of `prompts`, timing every engine step."""
    from netra_jax import SamplingParams

    engine = llm.engine
    steps: list[tuple[float, float]] = []
    real_step = engine.step

    def timed_step():
        w0, c0, t0 = engine.device_wait_s, time.thread_time(), time.perf_counter()
        out = real_step()
        steps.append((time.perf_counter() - t0, engine.device_wait_s - w0, time.thread_time() - c0))
        return out

    engine.step = timed_step
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        del engine.step
    total = time.perf_counter() - t0
    decode = steps[2:-1]  # past the prefill (and, overlapped, the step that reads it), before the drain
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tok_s": tokens / total,
        "step_ms": 1e3 * statistics.median(w for w, _, _ in decode),
        "host_ms": 1e3 * statistics.median(w - d for w, d, _ in decode),
        "wait_ms": 1e3 * statistics.median(d for _, d, _ in decode),
        "host_cpu_ms": 1e3 * statistics.median(c for _, _, c in decode),
        "steps": len(steps),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)


def run(a: argparse.Namespace) -> int:
    record = common.Run("host_overlap")  # the machine may be shared: its load goes into the result
    engines = {}
    for overlap in (False, True):
        t0 = time.perf_counter()
        llm = common.build_llm(a.model, max_num_seqs=max(a.batches), warmup=False, async_scheduling=overlap)
        engines[overlap] = llm
        print(f"built async_scheduling={overlap} in {time.perf_counter() - t0:.1f}s", flush=True)
    tok = engines[False].get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions(max(a.batches))]
    results = []
    for batch in a.batches:
        ps = prompts[:batch]
        for llm in engines.values():  # compile the buckets this batch uses (the second run hits the prefix cache)
            for _ in range(2):
                run_once(llm, ps, 4)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(a.repeats):
            for overlap in common.alternating((False, True), r):
                runs[overlap].append(run_once(engines[overlap], ps, a.max_tokens))
        same = runs[False][0]["token_ids"] == runs[True][0]["token_ids"]
        row = {"batch": batch, "max_tokens": a.max_tokens, "repeats": a.repeats, "identical_outputs": same}
        for overlap, rs in runs.items():
            key = "overlap" if overlap else "sync"
            row[key] = {
                k: statistics.median(r[k] for r in rs)
                for k in ("tok_s", "step_ms", "host_ms", "wait_ms", "host_cpu_ms")
            }
            row[key]["runs"] = [{k: round(v, 3) for k, v in r.items() if k != "token_ids"} for r in rs]
        s, o = row["sync"], row["overlap"]
        row["hidden_ms"] = s["step_ms"] - o["step_ms"]
        row["hidden_fraction_of_host"] = row["hidden_ms"] / s["host_ms"] if s["host_ms"] > 0 else None
        results.append(row)
        print(
            f"batch {batch:3d}: sync {s['tok_s']:7.1f} tok/s, step {s['step_ms']:6.2f} ms (host {s['host_ms']:5.2f},"
            f" wait {s['wait_ms']:6.2f}) | overlap {o['tok_s']:7.1f} tok/s, step {o['step_ms']:6.2f} ms (host "
            f"{o['host_ms']:5.2f}, wait {o['wait_ms']:6.2f}) | hidden {row['hidden_ms']:5.2f} ms "
            f"({100 * (row['hidden_fraction_of_host'] or 0):.0f}% of host), identical {same}",
            flush=True,
        )
    doc = record.record(
        model=common.model_label(a.model),
        dtype="float32",
        note="CPU: the device is XLA's CPU runtime sharing the cores with the Python thread",
        cpus=os.cpu_count(),
        results=results,
    )
    record.write(doc, a.out)
    return 0
