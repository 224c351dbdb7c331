"""Closed-loop A/B of scheduler settings in one process: C users each send a request (random prompt ids, fixed prompt
and output lengths, greedy, ignore_eos) and the next one when it finishes, as `netra-jax bench serve` does against
the server, but into one LLMEngine, so the variants share the compiled steps and alternate pass by pass.

Usage: `.venv/bin/python -m benchmarks.step_profile composition [--users 8,32] [--rounds 2] [--repeats 2]
        [--variants aligned:align_chunks_to_buckets=true plain:align_chunks_to_buckets=false] [--trace FILE]`
A variant sets SchedulerConfig fields that leave the step shapes alone (the engine's scheduler config is swapped
between passes). Arrivals: a user's next request comes 0..--jitter-ms after its previous one finished (the HTTP
round trip and tokenization the server would add), so steps see requests join one by one, as served ones do.
Writes benchmarks/results/<date>-step_composition.json (machine, load, per pass: output tok/s, TTFT, TPOT, steps,
bucket padding, process CPU) and prints a table of medians and each variant's ratio to the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import random
import statistics
import time

from benchmarks.step_profile import common

DEFAULT_VARIANTS = ("aligned:align_chunks_to_buckets=true", "plain:align_chunks_to_buckets=false")


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:field=value,field=value' -> (name, {field: value}); values are JSON (true, 512) or plain strings."""
    name, _, body = text.partition(":")
    fields = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected field=value, got {item!r}")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    return name, fields


def run_pass(engine, users, num_requests, prompt_len, output_len, jitter_s, seed: int, pass_id: int) -> dict:
    """One closed-loop pass: arrival jitter drawn from `seed`, prompts from `pass_id` (never the same twice: no
    prefix-cache hit from an earlier pass); returns its metrics."""
    from netra_jax import SamplingParams

    rng, ids = random.Random(seed), random.Random(1_000_003 * pass_id + seed)
    vocab = engine.vocab_size
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    run = engine.runner.run
    shapes: list[tuple[int, int]] = []  # (tokens, bucket) of every step of the pass

    def spy(out, *args, **kwargs):
        result = run(out, *args, **kwargs)
        shapes.append((out.num_batched_tokens, result.batch.shape.num_tokens))
        return result

    engine.runner.run = spy
    due: list[tuple[float, int]] = []  # (time, user) of requests not sent yet
    t0 = time.perf_counter()
    for u in range(users):
        heapq.heappush(due, (t0 + rng.uniform(0, jitter_s), u))
    sent = done = 0
    submitted, first, finished = {}, {}, {}
    c0 = time.process_time()
    try:
        while done < num_requests:
            now = time.perf_counter()
            while due and due[0][0] <= now and sent < num_requests:
                t, _ = heapq.heappop(due)
                rid = f"p{pass_id}-{sent}"
                prompt = [ids.randrange(vocab) for _ in range(prompt_len)]
                engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
                submitted[rid] = t
                sent += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, due[0][0] - time.perf_counter()) if due else 0.0)
                continue
            for out in engine.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                if out.finished:
                    finished[out.request_id] = now
                    done += 1
                    heapq.heappush(due, (now + rng.uniform(0, jitter_s), 0))
    finally:
        del engine.runner.run
    cpu = time.process_time() - c0
    duration = max(finished.values()) - t0
    ttft = [first[r] - submitted[r] for r in finished]
    tpot = [(finished[r] - first[r]) / (output_len - 1) for r in finished]
    padding = sum(b - t for t, b in shapes)
    return {
        "duration_s": duration,
        "output_tok_s": num_requests * output_len / duration,
        "mean_ttft_ms": 1e3 * statistics.mean(ttft),
        "median_ttft_ms": 1e3 * statistics.median(ttft),
        "median_tpot_ms": 1e3 * statistics.median(tpot),
        "steps": len(shapes),
        "padding_share": padding / max(1, sum(b for _, b in shapes)),
        "process_cpu_s": cpu,
        "load_average": os.getloadavg()[0],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=2, repeats_help="passes of each variant at each concurrency")
    p.add_argument("--users", default="8,32", help="comma list of concurrencies")
    p.add_argument("--rounds", type=int, default=2, help="requests per user in a pass")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--jitter-ms", type=float, default=20.0)
    p.add_argument("--variants", nargs="+", type=parse_variant, default=[parse_variant(v) for v in DEFAULT_VARIANTS])
    p.add_argument("--trace", default=None, help="also write a step trace of every pass (engine/step_trace.py)")


def print_table(results: list[dict]) -> None:
    print("\n| users | variant | output tok/s | ratio | median TTFT ms | median TPOT ms | steps | padding |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in results:
        for name, v in row["variants"].items():
            m = v["median"]
            print(
                f"| {row['users']} | {name} | {m['output_tok_s']:.1f} | {m['tok_s_ratio_to_first']:.3f} | "
                f"{m['median_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} | {m['steps']:.0f} | "
                f"{100 * m['padding_share']:.0f}% |"
            )


def run(a: argparse.Namespace) -> int:
    llm = common.build_llm(a.model)  # every bucket compiled first (the persistent cache makes it quick)
    engine = llm.engine
    base = engine.scheduler.config
    configs = {name: dataclasses.replace(base, **fields) for name, fields in a.variants}
    trace = engine.trace_steps(a.trace) if a.trace else None
    record = common.Run("step_composition")
    results, passes = [], 0
    for users in (int(u) for u in a.users.split(",")):
        n = users * a.rounds
        args = (users, n, a.prompt_len, a.output_len, a.jitter_ms / 1e3)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(a.repeats):
            for name in common.alternating(configs, r):
                engine.scheduler.config = configs[name]
                first_step = engine.runner.num_steps
                passes += 1
                m = run_pass(engine, *args, seed=r, pass_id=passes)  # the same arrival draws for every variant
                m["steps_range"] = [first_step, engine.runner.num_steps]
                runs[name].append(m)
                print(
                    f"users {users:3d} {name:>10s} pass {r}: {m['output_tok_s']:6.1f} tok/s, TTFT "
                    f"{m['median_ttft_ms']:7.0f} ms, TPOT {m['median_tpot_ms']:6.1f} ms, {m['steps']} steps, "
                    f"padding {100 * m['padding_share']:.0f}%, load {m['load_average']:.1f}",
                    flush=True,
                )
        row = {"users": users, "requests": n, "variants": {}}
        ref = None
        for name, rs in runs.items():
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "steps_range"}
            ref = ref or med
            med["tok_s_ratio_to_first"] = med["output_tok_s"] / ref["output_tok_s"]
            row["variants"][name] = {"median": med, "runs": rs}
        results.append(row)
    if trace is not None:
        trace.close()
    doc = record.record(
        model=common.model_label(a.model),
        dtype="float32",
        settings={k: v for k, v in vars(a).items() if k != "variants"},
        variants={name: fields for name, fields in a.variants},
        note="offline closed loop in one engine; variants alternate pass by pass; medians of --repeats passes",
        results=results,
    )
    record.write(doc, a.out)
    print_table(results)
    return 0
