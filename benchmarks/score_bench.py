"""Scoring throughput: 64 multiple-choice (prompt, continuation) pairs scored by `LLM.score_continuations` (float32),
against transformers' batched forward on the same weights and token ids in the same run; both must give the same
per-pair log-likelihoods (max |diff| <= 1e-3) and greedy flags.

Pairs: lm-eval style 5-shot multiple choice from the committed task file tests/fixtures/lm_eval/mc.jsonl: the first
5 documents (question and answer) make the shared few-shot context, each of the next 16 documents' question ends
it, and each of its 4 choices (" " + choice) is a continuation. The texts are tokenized as lm-eval pairs them
(`netra_jax.scoring.encode_pair`); transformers gets the very token ids netra-jax scored.

Usage: `.venv/bin/python -m benchmarks.score_bench [--model PATH] [--repeats N] [--no-hf] [--no-logits-path]
[--hf-python PY] [--out FILE]`. Writes benchmarks/results/<date>-score_bench.json and a short .md next to it.

Every timed run starts from an empty prefix cache (reset_prefix_cache), so the hits it reports are those of its
own shared prompts. The baseline runs in the Python 3.11 interpreter with torch + transformers (found as
benchmarks/hf_baseline.py says) as a subprocess of this module with `--hf-worker`, loading the GGUF file with
transformers' GGUF loader (de-quantized to float32: the weights netra-jax's loader produces), one forward of all
pairs right-padded, log-softmax at the continuation positions. `--no-logits-path` skips the third measurement:
the per-prompt `LLM.logits` hook, one forward per pair (its compile per length done before timing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.hf_baseline import BaselineWorker, find_hf_python, load_model
from benchmarks.phases import Phase, run_record

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MC = REPO / "tests" / "fixtures" / "lm_eval" / "mc.jsonl"
TOLERANCE = 1e-3  # |ours - transformers| per pair's log-likelihood


def mc_pairs(num_shots: int = 5, num_docs: int = 16) -> tuple[list[str], list[str], list[int]]:
    """(prompts, continuations, document of each pair): num_docs documents x their 4 choices after a shared
    num_shots-example context."""
    docs = [json.loads(line) for line in MC.read_text().splitlines() if line.strip()]
    if num_shots + num_docs > len(docs):
        raise ValueError(f"mc.jsonl has {len(docs)} documents, {num_shots} shots + {num_docs} asked")
    shots = "".join(f"{d['question']} {d['choices'][d['answer']]}.\n" for d in docs[:num_shots])
    prompts, conts, doc_of = [], [], []
    for i, d in enumerate(docs[num_shots : num_shots + num_docs]):
        for choice in d["choices"]:
            prompts.append(shots + d["question"])
            conts.append(" " + choice)
            doc_of.append(i)
    return prompts, conts, doc_of


# ---------------------------------------------------------------------------------------------------- ours
class Ours:
    """Our engine as LLM builds it by default (each program compiled on first use: the untimed first scoring compiles
    what the runs need); each run scores all pairs from an empty prefix cache."""

    def __init__(self, args, prompts: list[str], conts: list[str], phases: dict):
        from netra_jax import LLM

        self.prompts, self.conts = prompts, conts
        with Phase(phases, "ours_build") as ph:
            self.llm = LLM(args.model, dtype="float32", max_num_seqs=len(prompts))
        self.build_s = ph.rec["wall_s"]
        with Phase(phases, "ours_warmup"):
            self.scores = self.llm.score_continuations(prompts, conts)

    def run(self, prefix_caching: bool = True) -> dict:
        """One timed scoring of every pair from an empty prefix cache; `prefix_caching` False: with the pool's
        prefix caching off for the run (every pair computes all its tokens, as transformers does)."""
        eng = self.llm.engine
        eng.pool.reset_prefix_cache()
        hits, steps = eng.pool.prefix_hits_tokens, eng.runner.num_steps
        eng.pool.enable_prefix_caching = prefix_caching
        t0 = time.perf_counter()
        try:
            self.scores = self.llm.score_continuations(self.prompts, self.conts)
        finally:
            eng.pool.enable_prefix_caching = True
        dt = time.perf_counter() - t0
        n = sum(len(s.prompt_token_ids) + len(s.continuation_token_ids) for s in self.scores)
        return {
            "total_s": dt,
            "tok_s": n / dt,
            "pairs_s": len(self.scores) / dt,
            "prefix_hit_tokens": eng.pool.prefix_hits_tokens - hits,
            "steps": eng.runner.num_steps - steps,
        }

    def token_ids(self) -> list[tuple[list[int], list[int]]]:
        return [(s.prompt_token_ids, s.continuation_token_ids) for s in self.scores]

    def logits_path(self, repeats: int) -> dict:
        """The per-prompt `LLM.logits` hook on every pair, one forward each (after one pass that compiles its
        lengths): the sum of log_softmax at the continuation positions."""
        import numpy as np

        def once() -> list[float]:
            out = []
            for ctx, cont in self.token_ids():
                logits = self.llm.logits(ctx + cont).astype(np.float64)  # [tokens, vocab]
                rows = logits[len(ctx) - 1 : -1]
                m = rows.max(-1, keepdims=True)
                lse = m[:, 0] + np.log(np.exp(rows - m).sum(-1))
                out.append(float(sum(rows[i, t] - lse[i] for i, t in enumerate(cont))))
            return out

        t0 = time.perf_counter()
        sums = once()
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        n = sum(len(a) + len(b) for a, b in self.token_ids())
        mine = [s.logprob for s in self.scores]
        return {
            "first_pass_s": round(first, 3),
            "total_s": round(dt, 4),
            "tok_s": round(n / dt, 1),
            "runs_s": [round(t, 4) for t in times],
            "max_abs_diff_vs_score_continuations": max(abs(a - b) for a, b in zip(sums, mine, strict=True)),
        }


# ---------------------------------------------------------------------------------------------------- transformers
def hf_worker(inp: str) -> None:
    """Runs in the baseline interpreter: load the weights, warm up, then answer one JSON line per command on stdin
    ("run": time one batched scoring of every pair; "quit": info and the last run's sums and greedy flags)."""
    import torch
    import transformers

    job = json.loads(Path(inp).read_text())
    torch.set_num_threads(os.cpu_count())
    t0 = time.perf_counter()
    model = load_model(job["model"])
    info = {
        "load_s": round(time.perf_counter() - t0, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
    }
    pairs, pad = job["pairs"], job["pad_id"]
    seqs = [ctx + cont for ctx, cont in pairs]
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])  # right padding: positions stay 0..len-1
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    b_idx = torch.tensor([i for i, (ctx, cont) in enumerate(pairs) for _ in cont])
    p_idx = torch.tensor([len(ctx) - 1 + j for ctx, cont in pairs for j in range(len(cont))])
    target = torch.tensor([t for _, cont in pairs for t in cont])
    last: dict = {}

    def score() -> dict:
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits  # [pairs, L, vocab]
            rows = logits[b_idx, p_idx].double()  # [continuation tokens, vocab]
            lp = torch.log_softmax(rows, -1).gather(1, target[:, None])[:, 0]
            greedy = rows.argmax(-1) == target
        dt = time.perf_counter() - t0
        sums, flags, k = [], [], 0
        for _, cont in pairs:
            sums.append(float(lp[k : k + len(cont)].sum()))
            flags.append(bool(greedy[k : k + len(cont)].all()))
            k += len(cont)
        last.update(sums=sums, is_greedy=flags)
        n = sum(len(s) for s in seqs)
        return {"total_s": dt, "tok_s": n / dt, "pairs_s": len(pairs) / dt}

    score()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            print(json.dumps({"info": info, **last}), flush=True)
            return
        print(json.dumps(score()), flush=True)


# ---------------------------------------------------------------------------------------------------- report
def median_run(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    med = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    return {
        "median": med,
        "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in runs],
    }


def markdown(result: dict) -> str:
    from netra_jax.bench.machine import describe

    s, o, h, lp = result["settings"], result["ours"], result.get("hf") or {}, result.get("logits_path")
    lines = [
        f"# Scoring {s['num_pairs']} (prompt, continuation) pairs: {Path(s['model']).name}, float32",
        "",
        f"{result['date']}; {describe(result['machine'])}; {s['num_tokens']} tokens"
        f" ({s['num_continuation_tokens']} scored), {s['num_shots']}-shot multiple choice from"
        f" tests/fixtures/lm_eval/mc.jsonl, {s['repeats']} timed runs each (medians).",
        "",
        "| | seconds | tok/s | pairs/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    om = o["median"]
    lines.append(
        f"| netra-jax `LLM.score_continuations` | {om['total_s']:.3f} | {om['tok_s']:.0f} | {om['pairs_s']:.1f} |"
    )
    nm = result["ours_no_prefix_cache"]["median"]
    lines.append(f"| netra-jax, prefix caching off | {nm['total_s']:.3f} | {nm['tok_s']:.0f} | {nm['pairs_s']:.1f} |")
    if "median" in h:
        hm = h["median"]
        lines.append(
            f"| transformers, one batched forward | {hm['total_s']:.3f} | {hm['tok_s']:.0f} | {hm['pairs_s']:.1f} |"
        )
    if lp:
        pairs_s = s["num_pairs"] / lp["total_s"]
        lines.append(
            f"| netra-jax `LLM.logits`, one forward per pair | {lp['total_s']:.3f} | {lp['tok_s']:.0f} |"
            f" {pairs_s:.1f} |"
        )
    lines += [
        "",
        f"tok/s: prompt + continuation tokens a second. netra-jax takes {om['steps']:.0f} engine steps a run and"
        f" finds {om['prefix_hit_tokens']:.0f} of the {s['num_tokens']} tokens in the prefix cache (the shared"
        " few-shot context and question), so it computes the rest; transformers computes all of them.",
    ]
    if "agreement" in result:
        a = result["agreement"]
        lines.append(
            f"Agreement with transformers: max |sum diff| {a['max_abs_diff']:.2e} (tolerance {TOLERANCE:g}),"
            f" is_greedy equal on {a['is_greedy_equal']} of {a['pairs']} pairs, best choice equal on"
            f" {a['best_choice_equal']} of {a['documents']} documents."
        )
    timed = [
        v["others_cores"] for k, v in result["phases"].items() if k[-1].isdigit() and v["others_cores"] is not None
    ]
    if timed:
        lines.append(f"Other processes used at most {max(timed):.2f} cores during the timed runs.")
    if h.get("info"):
        i = h["info"]
        lines.append(
            f"transformers {i['transformers']}, torch {i['torch']}, {i['threads']} threads,"
            f" attention {i['attn_implementation']}."
        )
    return "\n".join(lines) + "\n"


def agreement(ours, hf: dict, doc_of: list[int]) -> dict:
    mine = [s.logprob for s in ours]
    theirs = hf["sums"]

    def best(sums):
        by_doc: dict[int, list[tuple[float, int]]] = {}
        for k, (x, d) in enumerate(zip(sums, doc_of, strict=True)):
            by_doc.setdefault(d, []).append((x, k))
        return [max(v)[1] for _, v in sorted(by_doc.items())]

    diff = max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
    return {
        "pairs": len(mine),
        "max_abs_diff": diff,
        "within_tolerance": diff <= TOLERANCE,
        "is_greedy_equal": sum(s.is_greedy == g for s, g in zip(ours, hf["is_greedy"], strict=True)),
        "documents": len(set(doc_of)),
        "best_choice_equal": sum(a == b for a, b in zip(best(mine), best(theirs), strict=True)),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each side")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-logits-path", dest="logits_path", action="store_false")
    ap.add_argument("--hf-python", default=None, help="interpreter with torch + transformers for the baseline")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/<date>-score_bench.json)")
    ap.add_argument("--hf-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hf_worker:
        hf_worker(args.hf_worker)
        return {}

    from netra_jax.bench.machine import machine_info
    from netra_jax.bench.results import write_result
    from netra_jax.engine.factory import resolve_model_path

    args.model = resolve_model_path(args.model)
    phases: dict = {}
    result = run_record("score_bench", phases) | {"machine": machine_info()}
    prompts, conts, doc_of = mc_pairs()
    ours = Ours(args, prompts, conts, phases)
    pairs = ours.token_ids()
    result["settings"] = {
        "model": args.model,
        "dtype": "float32",
        "num_pairs": len(pairs),
        "num_shots": 5,
        "num_tokens": sum(len(a) + len(b) for a, b in pairs),
        "num_continuation_tokens": sum(len(b) for _, b in pairs),
        "prompt_lens": sorted({len(a) for a, _ in pairs}),
        "repeats": args.repeats,
        "max_num_seqs": len(pairs),
        "max_num_batched_tokens": ours.llm.engine.config.scheduler.max_num_batched_tokens,
        "build_s": ours.build_s,
    }
    hf_python = None if args.no_hf else find_hf_python(args.hf_python)
    tok = ours.llm.get_tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_ids or [0])[0]
    client = None
    if hf_python:  # a long-lived worker, so its runs interleave with ours under the same load
        client = BaselineWorker(hf_python, __spec__.name, {"model": args.model, "pairs": pairs, "pad_id": pad})
        Phase.children.append(client.proc.pid)
    hf: dict | None = None if args.no_hf else {"error": "no interpreter with torch + transformers found"}
    runs: dict[str, list[dict]] = {"ours": [], "hf": [], "ours_no_prefix_cache": []}
    try:
        if client:
            with Phase(phases, "hf_load_and_warmup"):
                client.ask(None)
        for i in range(args.repeats):  # paired runs, alternating who goes first, under the same load
            order = ["ours", "hf", "ours_no_prefix_cache"]
            for who in order if i % 2 == 0 else order[::-1]:
                if who == "hf" and client is None:
                    continue
                with Phase(phases, f"{who}_{i}") as ph:
                    r = client.ask("run") if who == "hf" else ours.run(who == "ours")
                runs[who].append(dict(r, others_cores=ph.rec["others_cores"]))
        if client:
            hf = client.close()
            client = None
            hf |= median_run(runs["hf"])
            result["agreement"] = agreement(ours.scores, hf, doc_of)
            pairs_run = zip(runs["ours"], runs["hf"], strict=True)
            hf["paired_speedup"] = [round(h["total_s"] / o["total_s"], 3) for o, h in pairs_run]
    except RuntimeError as e:
        hf = {"error": str(e)}
    finally:
        if client:
            client.proc.kill()
    result["ours"] = median_run(runs["ours"])
    result["ours_no_prefix_cache"] = median_run(runs["ours_no_prefix_cache"])
    result["hf"] = hf
    if args.logits_path:
        with Phase(phases, "ours_logits_path"):
            result["logits_path"] = ours.logits_path(max(1, args.repeats // 2))
    result["scores"] = [
        {"doc": d, "logprob": round(s.logprob, 5), "is_greedy": s.is_greedy, "continuation": c}
        for s, d, c in zip(ours.scores, doc_of, conts, strict=True)
    ]
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path = write_result(result, "score_bench", HERE / "results", args.out)
    md = path.with_suffix(".md")
    md.write_text(markdown(result))
    print(md.read_text())
    if "agreement" in result and not result["agreement"]["within_tolerance"]:
        raise SystemExit(f"sums differ from transformers by {result['agreement']['max_abs_diff']:.2e}")
    return result


if __name__ == "__main__":
    main()
