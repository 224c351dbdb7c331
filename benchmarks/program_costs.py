"""What each compiled program costs and what padding a step to a larger bucket costs: the figures the engine's program
set (`netra_jax.engine.buckets`) is chosen from.

    .venv/bin/python -m benchmarks.program_costs                 # the default model with `netra-jax serve`'s options
    .venv/bin/python -m benchmarks.program_costs --model DIR --engine-args '{"max_num_seqs": 16}'

Compile: every program a full warm-up compiles (`engine.warmup.engine_variants`), one at a time on one thread with
the persistent compilation cache off: seconds to trace and lower it, to compile it, and to load it back from its
serialized form (what a warm cache or a bundle costs per program). Run: a step's seconds in each token bucket with
every token real, measured through the engine: decode steps of B running sequences (B a power of two: a full
bucket) and prefill steps of one prompt filling the bucket; the median of `--steps` steps. Padding n tokens up to
bucket T costs about run(T) - run(n). Writes benchmarks/results/<date>-program_costs[_<label>].json."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result

RESULTS = Path(__file__).resolve().parent / "results"


def compile_costs(engine) -> list[dict]:
    """Lower, compile and deserialize every program of the engine's full warm-up, one at a time."""
    from jax.experimental import serialize_executable as se

    from netra_jax.engine.warmup import engine_variants

    out = []
    engine.runner.set_prompt_logprob_buckets(fine=False)  # the warm-up's set (engine.warmup)
    for v in engine_variants(engine.runner, engine.vocab_size):
        t0 = time.perf_counter()
        lowered = v.lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        blob, in_tree, out_tree = se.serialize(compiled)
        t3 = time.perf_counter()
        se.deserialize_and_load(blob, in_tree, out_tree)
        t4 = time.perf_counter()
        row = {
            "kind": v.kind,
            "label": v.label,
            "lower_s": round(t1 - t0, 3),
            "compile_s": round(t2 - t1, 3),
            "load_s": round(t4 - t3, 3),
            "bytes": len(blob),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _step_seconds(engine, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:
    """(seconds from admitting `prompts` together to every one's first token, seconds per decode step over the next
    `decode_steps` steps of them all)."""
    from netra_jax import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 4, temperature=0, ignore_eos=True)
    ids = [f"cost-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    t = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    decode = (time.perf_counter() - t) / max(decode_steps, 1)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.settle()
    return prefill, decode


def run_costs(engine, decode_steps: int, seed: int = 0) -> dict:
    """Seconds of a decode step of B sequences in bucket B and of a prefill step of T prompt tokens in bucket T."""
    rng = np.random.default_rng(seed)
    buckets = engine.runner.buckets
    top = engine.runner.max_step_tokens
    vocab = min(engine.vocab_size, 30000)
    decode, prefill = {}, {}
    seqs = [b for b in buckets if b <= engine.config.scheduler.max_num_seqs]
    for b in seqs:
        prompts = [rng.integers(10, vocab, 16).tolist() for _ in range(b)]
        _step_seconds(engine, prompts, 2)  # compiles what the step needs, untimed
        _, dec = _step_seconds(engine, prompts, decode_steps)
        decode[b] = round(dec, 5)
        print(json.dumps({"decode_rows": b, "step_s": decode[b]}), flush=True)
    for t in [b for b in buckets if b <= top and b >= 16]:
        prompt = rng.integers(10, vocab, t).tolist()
        _step_seconds(engine, [prompt], 0)
        runs = [_step_seconds(engine, [rng.integers(10, vocab, t).tolist()], 0)[0] for _ in range(3)]
        prefill[t] = round(statistics.median(runs), 5)
        print(json.dumps({"prefill_tokens": t, "step_s": prefill[t]}), flush=True)
    return {"decode_step_s": decode, "prefill_step_s": prefill}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.program_costs", description=__doc__)
    p.add_argument("--model", default=None, help="a checkpoint (default: the embedded default model)")
    p.add_argument("--engine-args", default="{}", help="EngineArgs fields as JSON (serve's defaults otherwise)")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--skip", choices=("compile", "run"), default=None, help="leave one half out")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from netra_jax.engine_args import EngineArgs, load_engine

    fields = {"model": a.model, "warmup": False, "compilation_cache_dir": "", **json.loads(a.engine_args)}
    engine = load_engine(EngineArgs(**fields).create_engine_config())
    result = {
        "benchmark": "program_costs",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": a.model or "default (SmolLM2-135M-Instruct Q4_1)",
        "engine_args": fields,
        "buckets": list(engine.runner.buckets),
        "machine": machine_info(),
    }
    if a.skip != "compile":
        rows = compile_costs(engine)
        result["programs"] = rows
        result["compile_s_by_kind"] = {
            k: round(sum(r["compile_s"] + r["lower_s"] for r in rows if r["kind"] == k), 2)
            for k in dict.fromkeys(r["kind"] for r in rows)
        }
    if a.skip != "run":
        result.update(run_costs(engine, a.steps))
    write_result(result, f"program_costs{'_' + a.label if a.label else ''}", RESULTS, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
