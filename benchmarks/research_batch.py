"""Batched research calls against one call per prompt or patch, in the same run on the same engine: LLM.run_with_cache
over N prompts against N LLM.run_with_hooks calls (the same activations to float32 rounding), and the
indirect-object patching sweep (netra_jax.patching_sweep, every layer's resid_pre x every position) against one
run_with_hooks per patch (the same logits), with the sweep's layer x position map of the normalized logit difference.

Usage: `.venv/bin/python -m benchmarks.research_batch [--model PATH] [--prompts N] [--out FILE]`. Writes
benchmarks/results/<date>-research_batch.json. Each path runs once untimed first (its programs compile on first use),
then timed; the first call's time is reported too. Prompts: the questions of tests/fixtures/lm_eval/mc.jsonl, each
with its first choice (ragged lengths), repeated with a numbered prefix up to N.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result

REPO = Path(__file__).resolve().parents[1]
MC = REPO / "tests" / "fixtures" / "lm_eval" / "mc.jsonl"
IOI = "When Mary and John went to the store, John gave a drink to"


def prompts(n: int) -> list[str]:
    docs = [json.loads(line) for line in MC.read_text().splitlines() if line.strip()]
    texts = [f"{d['question']} {d['choices'][0]}." for d in docs]
    return [texts[i % len(texts)] if i < len(texts) else f"{i}. {texts[i % len(texts)]}" for i in range(n)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cache_vs_single(llm, texts: list[str]) -> dict:
    from netra_jax import Hooks
    from netra_jax.models.hooks import hook_name

    cfg = llm.model_config
    names = [hook_name(i, p) for i in range(cfg.num_layers) for p in ("attn_out", "mlp_out", "resid_post")]
    names.append("final_norm")
    ids = [llm.get_tokenizer().encode(t) for t in texts]
    _, cold_batched = timed(lambda: llm.run_with_cache(ids, names=names))
    batched, warm_batched = timed(lambda: llm.run_with_cache(ids, names=names))
    hooks = Hooks(record=names)
    _, cold_single = timed(lambda: [llm.run_with_hooks(p, hooks) for p in ids])
    single, warm_single = timed(lambda: [llm.run_with_hooks(p, hooks) for p in ids])
    diff, worst = 0.0, None  # the largest difference relative to the tensor's largest value
    for b, one in zip(batched, single, strict=True):
        for n in names:
            d = float(np.abs(b[n] - one.activations[n]).max() / np.abs(one.activations[n]).max())
            if d > diff:
                diff, worst = d, n
    return {
        "prompts": len(ids),
        "tokens": sum(map(len, ids)),
        "names": len(names),
        "run_with_cache_s": warm_batched,
        "run_with_cache_first_call_s": cold_batched,
        "run_with_hooks_each_s": warm_single,
        "run_with_hooks_each_first_pass_s": cold_single,
        "speedup": warm_single / warm_batched,
        "max_diff_relative_to_tensor_max": diff,
        "max_diff_at": worst,
    }


def ioi_sweep(llm) -> dict:
    from netra_jax import Hooks, patch, patching_sweep
    from netra_jax.models.hooks import hook_name

    cfg, tok = llm.model_config, llm.get_tokenizer()
    clean = tok.encode(IOI)
    corrupt = list(clean)
    corrupt[-5] = clean[1]  # the second " John" becomes " Mary"
    io, s = clean[1], clean[3]
    points = [hook_name(i, "resid_pre") for i in range(cfg.num_layers)]
    _, cold = timed(lambda: patching_sweep(llm, clean, corrupt, points))
    sweep, warm = timed(lambda: patching_sweep(llm, clean, corrupt, points))
    source = llm.run_with_cache([clean], names=points)[0]

    def loop():
        out = np.zeros_like(sweep.logits)
        for i, name in enumerate(points):
            for p in range(len(clean)):
                data = {name: {"values": source[name], "mask": np.arange(len(clean)) == p}}
                out[i, p] = llm.run_with_hooks(corrupt, Hooks(edit={name: patch}, data=data)).logits[-1]
        return out

    loop_logits, loop_s = timed(loop)
    effect = sweep.normalized(lambda lg: float(lg[io] - lg[s]))
    return {
        "clean": IOI,
        "tokens": [tok.decode([t]) for t in corrupt],
        "corrupted_position": len(clean) - 5,
        "patched_runs": len(points) * len(clean),
        "sweep_s": warm,
        "sweep_first_call_s": cold,
        "sweep_engine_s": sweep.seconds,
        "one_call_per_patch_s": loop_s,
        "speedup": loop_s / warm,
        "max_abs_logit_diff_vs_loop": float(np.abs(sweep.logits - loop_logits).max()),
        "logit_diff_clean": float(sweep.clean_logits[io] - sweep.clean_logits[s]),
        "logit_diff_corrupted": float(sweep.corrupted_logits[io] - sweep.corrupted_logits[s]),
        "normalized_effect": np.round(effect, 3).tolist(),  # [layer][position]
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from netra_jax import LLM

    llm = LLM(args.model, max_num_seqs=64)
    doc = {
        "benchmark": "research_batch",
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "machine": machine_info(),
        "run_with_cache": cache_vs_single(llm, prompts(args.prompts)),
        "ioi_patching_sweep": ioi_sweep(llm),
    }
    for part in ("run_with_cache", "ioi_patching_sweep"):
        print(part, {k: v for k, v in doc[part].items() if k not in ("normalized_effect", "tokens")})
    write_result(doc, "research_batch", REPO / "benchmarks" / "results", args.out)


if __name__ == "__main__":
    main()
