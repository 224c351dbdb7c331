"""Offline speculative-decoding A/B in one process: the default model (SmolLM2-135M-Instruct) in float32 with n-gram
speculation against the same engine without it, greedy, on the input-grounded prompt set and on free-form chat.

Usage: `.venv/bin/python -m benchmarks.spec_decode [--quick] [--repeats 3] [--batch 1,8] [--sets grounded,chat]
[--k 5 --ngram-max 4 --ngram-min 2] [--model PATH]` (or `make bench-spec`). Both engines are built first and stay
loaded; each repeat runs every (prompt set, batch) point on both, the order alternating between repeats, so machine
load hits both sides alike. Batch b: the set's chat requests go to `LLM.chat` b at a time, in file order. Output
tok/s = generated tokens / wall time of the point; the best (fastest) repeat of each side is reported, and the
speed-up is best / best (the median of same-repeat ratios beside it). Acceptance (rate, mean accepted length,
per position) comes from the speculative engine's counters over the point. Greedy token ids must be identical to
the engine without speculation for every request and repeat: the exit status is 1 when any differs.
Writes benchmarks/results/<date>-spec_decode.json and .md (--out: another JSON path; the .md goes beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT_DIR = HERE / "prompts"
SETS = {"grounded": PROMPT_DIR / "grounded.jsonl", "chat": PROMPT_DIR / "chat.jsonl"}


def load_set(name: str, limit: int | None, max_tokens: int | None) -> list[dict]:
    """The set's requests ({"id", "messages", "max_tokens"}), the first `limit`, max_tokens capped when given."""
    rows = [json.loads(line) for line in SETS[name].read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    if max_tokens:
        rows = [r | {"max_tokens": min(r["max_tokens"], max_tokens)} for r in rows]
    return rows


def spec_counts(llm) -> dict | None:
    """The engine's cumulative speculative counters, or None without speculation."""
    return llm.engine.spec_stats()


def run_point(llm, rows: list[dict], batch: int) -> dict:
    """All of `rows` through `llm`, `batch` requests at a time: wall time, token ids and acceptance over the run."""
    from netra_jax import SamplingParams
    from netra_jax.bench import spec_metrics

    before = spec_counts(llm)
    ids: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(rows), batch):
        group = rows[i : i + batch]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in group]
        outs = llm.chat([r["messages"] for r in group], params, use_tqdm=False)
        ids += [list(o.outputs[0].token_ids) for o in outs]
    seconds = time.perf_counter() - start
    tokens = sum(len(x) for x in ids)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "token_ids": ids,
        "spec_decode": spec_metrics.delta(spec_counts(llm), before),
    }


def compare(base: dict, spec: dict, rows: list[dict]) -> dict:
    """Whether the two runs produced the same greedy tokens, and where the first difference is."""
    diffs = []
    for r, a, b in zip(rows, base["token_ids"], spec["token_ids"], strict=True):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            diffs.append({"id": r["id"], "first_difference_at": at, "lengths": [len(a), len(b)]})
    return {"identical": not diffs, "differences": diffs}


def build(model: str | None, spec: dict | None, kv_bytes: int, max_num_seqs: int, warmup: bool):
    from netra_jax import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype="float32",
        max_num_seqs=max_num_seqs,
        kv_cache_memory=kv_bytes,
        speculative_config=spec,
        warmup=warmup,
    )
    print(f"engine {'with' if spec else 'without'} speculation ready in {time.perf_counter() - t0:.1f}s", flush=True)
    return llm


def measure(engines: dict, sets: dict[str, list[dict]], batches: list[int], repeats: int) -> list[dict]:
    """Every (set, batch) point on both engines, `repeats` times, the order alternating; one summary per point."""
    points = []
    for name, rows in sets.items():
        for batch in batches:
            warm = [r | {"max_tokens": min(r["max_tokens"], 16)} for r in rows[:batch]]
            for llm in engines.values():  # anything the first steps of this shape compile or allocate lazily
                run_point(llm, warm, batch)
            runs: dict[str, list[dict]] = {"base": [], "spec": []}
            for rep in range(repeats):
                order = ("base", "spec") if rep % 2 == 0 else ("spec", "base")
                for side in order:
                    runs[side].append(run_point(engines[side], rows, batch))
                b, s = runs["base"][-1], runs["spec"][-1]
                print(
                    f"{name} batch {batch} repeat {rep + 1}/{repeats}: without {b['output_tok_s']:.1f} tok/s, "
                    f"with {s['output_tok_s']:.1f} tok/s ({s['output_tok_s'] / b['output_tok_s']:.2f}x)",
                    flush=True,
                )
            points.append(summarize_point(name, batch, rows, runs))
    return points


def summarize_point(name: str, batch: int, rows: list[dict], runs: dict[str, list[dict]]) -> dict:
    best = {side: max(rs, key=lambda r: r["output_tok_s"]) for side, rs in runs.items()}
    checks = [compare(runs["base"][0], s, rows) for s in runs["spec"]]
    checks += [compare(runs["base"][0], b, rows) for b in runs["base"][1:]]  # repeats agree among themselves
    same_rep = [s["output_tok_s"] / b["output_tok_s"] for b, s in zip(runs["base"], runs["spec"], strict=True)]
    spec = best["spec"]["spec_decode"] or {}
    return {
        "set": name,
        "batch": batch,
        "requests": len(rows),
        "output_tokens": best["base"]["output_tokens"],
        "base_tok_s": best["base"]["output_tok_s"],
        "spec_tok_s": best["spec"]["output_tok_s"],
        "speedup": best["spec"]["output_tok_s"] / best["base"]["output_tok_s"],
        "speedup_median_same_repeat": statistics.median(same_rep),
        "base_tok_s_all": [r["output_tok_s"] for r in runs["base"]],
        "spec_tok_s_all": [r["output_tok_s"] for r in runs["spec"]],
        "acceptance_rate": spec.get("acceptance_rate"),
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "spec_decode": spec,
        "identical": all(c["identical"] for c in checks),
        "differences": [d for c in checks for d in c["differences"]][:10],
    }


def markdown(res: dict) -> str:
    from netra_jax.bench.machine import describe

    num = lambda v, f: "-" if v is None else format(v, f)
    c = res["config"]
    lines = [
        f"# Speculative decoding, offline A/B ({res['date'][:10]})",
        "",
        f"- Model: {c['model']}, float32, greedy; n-gram speculation `{json.dumps(c['speculative_config'])}` "
        "against the same engine without it, both loaded in one process.",
        f"- Repeats: {c['repeats']} per point, order alternating; tok/s of the best repeat of each side.",
        f"- Machine: {describe(res['machine'])}.",
        f"- Command: `{c['command']}`",
        "",
        "| prompt set | batch | requests | output tokens | without tok/s | with tok/s | speed-up | draft acceptance "
        "| mean acceptance length | identical greedy tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in res["points"]:
        cells = [
            p["set"],
            str(p["batch"]),
            str(p["requests"]),
            str(p["output_tokens"]),
            f"{p['base_tok_s']:.1f}",
            f"{p['spec_tok_s']:.1f}",
            f"{p['speedup']:.2f}x",
            num(p["acceptance_rate"], ".1%"),
            num(p["mean_acceptance_length"], ".2f"),
            "yes" if p["identical"] else f"NO ({len(p['differences'])} requests differ)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sets", default="grounded,chat", help=f"comma list of {', '.join(SETS)}")
    p.add_argument("--batch", type=_ints, default=[1, 8], help="comma list of requests per LLM.chat call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min")
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="the speculative engine's disable_by_batch_size (default: none, so every point measures speculation)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="first N requests of each set (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each request's max_tokens")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="KV bytes of each engine")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="build the engines without compiling every step shape first (each point's untimed warm-up still runs)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 4 prompts, 16 tokens, batch 1,2, one repeat, --no-warmup"
    )
    p.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/<date>-spec_decode.json)")
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.max_tokens, a.repeats = a.num_prompts or 4, a.max_tokens or 16, 1
        a.batch = sorted({min(b, 2) for b in a.batch})
        a.no_warmup = True
    a.sets = [s.strip() for s in a.sets.split(",") if s.strip()]
    unknown = [s for s in a.sets if s not in SETS]
    if unknown or not a.sets:
        p.error(f"--sets takes {', '.join(SETS)}; got {unknown or 'none'}")
    if a.repeats < 1 or not a.batch or min(a.batch) < 1:
        p.error("--repeats and every --batch value must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from netra_jax.bench.machine import machine_info

    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": a.k,
        "prompt_lookup_max": a.ngram_max,
        "prompt_lookup_min": a.ngram_min,
        "disable_by_batch_size": a.disable_by_batch_size,
    }
    sets = {name: load_set(name, a.num_prompts, a.max_tokens) for name in a.sets}
    engines = {
        "base": build(a.model, None, a.kv_cache_memory, max(a.batch), not a.no_warmup),
        "spec": build(a.model, spec_config, a.kv_cache_memory, max(a.batch), not a.no_warmup),
    }
    points = measure(engines, sets, a.batch, a.repeats)
    config = {k: v for k, v in vars(a).items() if k != "out"}
    config |= {
        "model": a.model or "SmolLM2-135M-Instruct, the embedded default",
        "speculative_config": spec_config,
        "command": " ".join(["python -m benchmarks.spec_decode", *(argv if argv is not None else sys.argv[1:])]),
    }
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": config,
        "points": points,
    }
    from netra_jax.bench.results import write_result

    out = write_result(res, "spec_decode", HERE / "results", a.out)
    table = markdown(res)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    print(f"wrote {out.with_suffix('.md')}")
    return 0 if all(p["identical"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
