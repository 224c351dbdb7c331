"""MoE decode on CPU: our engine against transformers on the same random Qwen3-MoE-style model (8 experts, top-2,
hidden 1024, 4 layers; created by transformers and saved as safetensors) in the same run, at batch 1 and batch 64.

Usage: `.venv/bin/python -m benchmarks.moe_decode [--quick] [--repeats N] [--hf-python PY] [--out-dir DIR]`.
Writes benchmarks/results/moe_decode_cpu.json and .md and prints the table.

Decode tokens/s on both sides = batch * (new - 1) / (time of a greedy generate of `new` tokens - time of one of a
single token): the prefill and the first token cancel out, what is left is `new - 1` decode steps. Prompts are random
token ids of one length (no padding on the transformers side, no prefix cache on ours), `temperature 0` and no EOS
stop on both sides. Runs are paired and alternate which side goes first, under the same load; the baseline is a
long-lived subprocess in an interpreter with torch + transformers (`--hf-python`, `NETRA_HF_PYTHON`, or found as
`benchmarks.hf_baseline.find_hf_python` does), started with this module and `--hf-worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.hf_baseline import find_hf_python, worker_env
from benchmarks.offline_throughput import start_worker
from benchmarks.phases import Phase, run_record

HERE = Path(__file__).resolve().parent

# Qwen3-MoE layout, scaled: Qwen3-30B-A3B has hidden 2048, 128 experts of width 768, top-8, 48 layers
MODEL = dict(
    hidden_size=1024,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    intermediate_size=2048,  # dense MLP width: unused, every layer is MoE
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=4096,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


NOTES = [
    "",
    "## Why the experts do not run through `jax.lax.ragged_dot` on CPU",
    "jax 0.11 lowers `ragged_dot` on CPU (XLA:CPU has no `ragged-dot` instruction) to one product of every row with "
    "every expert's weights, masked to the row's expert: experts times the FLOPs of the rows routed, and a decode "
    "step reads every expert even for one token (the last columns above). `models.moe.grouped_matmul` keeps "
    "`ragged_dot` for GPU and TPU and on CPU runs a loop per expert over blocks of its rows (static shapes, "
    "data-dependent trip counts, experts without rows skipped).",
    "",
    "## What is left",
    "XLA:CPU copies an expert's [K, N] slice of the stacked [experts, K, N] weight before its dot (a slice cannot "
    "feed a dot in place), so each used expert's weights are read twice and written once per step. With one array "
    "per expert the same loop was about 2x faster on the gate/up + down matmuls alone (8 experts, 1024 x 1024 and "
    "512 x 1024, one separate measurement on a loaded machine, not made by this script: 0.63 against 1.45 ms at 2 "
    "rows, 5.8 against 8.6 ms at 128 rows); that needs the parameter layout to change.",
]


# ---------------------------------------------------------------------------------------------------- baseline side
def make_model(out: str, seed: int) -> None:
    """(baseline interpreter) A random Qwen3MoeForCausalLM saved as float32 safetensors in `out`, with a word-level
    tokenizer that names every id (prompts are token ids; the tokenizer only has to decode what is generated)."""
    import tokenizers
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**MODEL, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"<{i}>": i for i in range(MODEL["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out, "tokenizer.json"))


def hf_worker(model_dir: str) -> None:
    """(baseline interpreter) Load the model, then answer one JSON line per command on stdin: {"prompts": [...],
    "new": n} -> {"s": seconds of one greedy generate of n tokens, "ids": the new ids}; "quit" -> info."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation,
    }
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            print(json.dumps(info), flush=True)
            return
        ids = torch.tensor(cmd["prompts"])
        n = cmd["new"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,  # no EOS stop, as ignore_eos on our side
                pad_token_id=0,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        dt = time.perf_counter() - t0
        print(json.dumps({"s": dt, "ids": out[:, ids.shape[1] :].tolist()}), flush=True)


class HF:
    """The baseline worker as a long-lived subprocess, so its runs interleave with ours under the same load."""

    def __init__(self, python: str, model_dir: str, log_dir: str):
        self.err = open(os.path.join(log_dir, "hf_stderr.txt"), "w+")
        self.proc = start_worker(python, __spec__.name, model_dir, self.err)
        self._read()  # loaded

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"the transformers worker failed: {self.err.read()[-3000:]}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["s"], r["ids"]

    def close(self) -> dict:
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        info = self._read()
        self.proc.wait(timeout=60)
        self.err.close()
        return info


# ---------------------------------------------------------------------------------------------------- our side
class Ours:
    """Our engine, every bucket compiled at build; no prefix cache, so each run computes its prompts in full."""

    def __init__(self, model_dir: str, max_seqs: int):
        from netra_jax import LLM

        self.llm = LLM(model_dir, dtype="float32", max_num_seqs=max_seqs, enable_prefix_caching=False, warmup=True)

    def num_params(self) -> int:
        import jax

        return sum(x.size for x in jax.tree.leaves(self.llm.engine.runner.params))

    @classmethod
    def with_ragged_dot(cls, model_dir: str, max_seqs: int) -> Ours:
        """Our engine with the experts as `jax.lax.ragged_dot` lowers on CPU (a masked product of every row with every
        expert) instead of `models.moe`'s CPU block loop: its warm-up traces every step shape with it."""
        import jax

        from netra_jax.models import moe

        keep, moe.grouped_matmul = moe.grouped_matmul, jax.lax.ragged_dot
        try:
            return cls(model_dir, max_seqs)
        finally:
            moe.grouped_matmul = keep

    def generate(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        from netra_jax import SamplingParams

        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, [list(o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------------------------------------------- measurement
def decode_run(engine, prompts: list[list[int]], new: int) -> dict:
    """One paired measurement: a 1-token and a `new`-token greedy generate of the same prompts."""
    t1, _ = engine.generate(prompts, 1)
    tn, ids = engine.generate(prompts, new)
    steps = new - 1
    return {"t1_s": t1, "tn_s": tn, "decode_tok_s": len(prompts) * steps / (tn - t1), "ids": ids}


def measure(engines: dict, batches, news, prompts, repeats: int, phases: dict) -> list[dict]:
    """Per batch size: `repeats` rounds of one decode_run per engine, the order rotating each round."""
    out = []
    names = list(engines)
    for b, n in zip(batches, news, strict=True):
        runs: dict = {name: [] for name in names}
        for i in range(repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                with Phase(phases, f"{name}_b{b}_{i}") as ph:
                    r = decode_run(engines[name], prompts[:b], n)
                runs[name].append(dict(r, others_cores=ph.rec["others_cores"]))
        entry = {"batch": b, "new_tokens": n, **{name: summarize(runs[name]) for name in names}}
        hf = entry["hf"]["decode_tok_s_median"]
        for name in names:
            if name != "hf":
                entry[name]["vs_hf"] = entry[name]["decode_tok_s_median"] / hf
                entry[name]["same_ids_as_hf"] = sum(
                    a == c for a, c in zip(runs[name][-1]["ids"], runs["hf"][-1]["ids"], strict=True)
                )
        out.append(entry)
        print(f"batch {b}: " + ", ".join(f"{k} {entry[k]['decode_tok_s_median']:.1f} tok/s" for k in names), flush=True)
    return out


def summarize(runs: list[dict]) -> dict:
    return {
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
        "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k != "ids"} for r in runs],
    }


def write_markdown(result: dict, path: Path) -> None:
    m, s, mo = result["machine"], result["settings"], result["settings"]["model"]
    hf = result.get("hf_info", {})
    ragged = "ours_ragged_dot" in result["batches"][0]
    lines = [
        f"# MoE decode on CPU, {result['date'][:10]} ({m.get('cpu_model')}, {m.get('cpu_count')} cores)",
        "",
        f"`python -m benchmarks.moe_decode`: a random Qwen3-MoE-style model made by transformers ({mo['num_experts']} "
        f"experts, top-{mo['num_experts_per_tok']}, hidden {mo['hidden_size']}, expert width "
        f"{mo['moe_intermediate_size']}, {mo['num_hidden_layers']} layers, vocab {mo['vocab_size']}; float32, "
        f"{s['num_params'] / 1e6:.1f} M parameters), prompts of {s['prompt_len']} random tokens, greedy. "
        f"Ours: jax {m.get('jax')}, `LLM` (jnp reference attention, experts by `models.moe.grouped_matmul`: on CPU "
        f"a loop per expert over blocks of its rows). Transformers {hf.get('transformers')} / torch "
        f"{hf.get('torch')}, `generate`, {hf.get('threads')} threads, attention `{hf.get('attn_implementation')}`, "
        f"experts `{hf.get('experts_implementation')}`. Decode tok/s = batch x (new - 1) / (t(new tokens) - "
        f"t(1 token)); {s['repeats']} rounds per batch size, the order of the engines rotating; median shown.",
        "",
        "| batch | new tokens | transformers | ours | ours / transformers | same greedy ids |"
        + (" ours with ragged_dot as jax lowers it on CPU | its ratio |" if ragged else ""),
        "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if ragged else ""),
    ]
    for b in result["batches"]:
        o = b["ours"]
        row = (
            f"| {b['batch']} | {b['new_tokens']} | {b['hf']['decode_tok_s_median']:.1f} tok/s | "
            f"{o['decode_tok_s_median']:.1f} tok/s | **{o['vs_hf']:.2f}** | {o['same_ids_as_hf']}/{b['batch']} |"
        )
        if "ours_ragged_dot" in b:
            r = b["ours_ragged_dot"]
            row += f" {r['decode_tok_s_median']:.1f} tok/s | {r['vs_hf']:.2f} |"
        lines.append(row)
    quiet = [p["others_cores"] for k, p in result["phases"].items() if k.startswith(("ours_", "hf_"))]
    lines += [
        "",
        f"Load: other processes used up to {max(quiet):.2f} cores during the timed phases (1-minute load average "
        f"{m['loadavg'][0]:.2f} at the start); per-run figures and the phases are in `moe_decode_cpu.json`.",
    ]
    path.write_text("\n".join(lines + NOTES) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64", help="batch sizes, comma separated")
    ap.add_argument("--new-tokens", default="64,32", help="new tokens per batch size")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 8 new tokens, one repeat")
    ap.add_argument("--hf-python", default=None, help="interpreter with torch + transformers")
    ap.add_argument("--also-ragged-dot", action="store_true", help="also time our engine with jax's ragged_dot")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--make-model", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--hf-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.seed)
        return {}
    if args.hf_worker:
        hf_worker(args.hf_worker)
        return {}
    batches = [int(b) for b in args.batches.split(",")]
    news = [int(n) for n in args.new_tokens.split(",")]
    if args.quick:
        batches, news, args.repeats = [1, 4], [8, 8], 1
    python = find_hf_python(args.hf_python)
    if python is None:
        raise SystemExit("no interpreter with torch + transformers: pass --hf-python or set NETRA_HF_PYTHON")
    tmp = tempfile.mkdtemp(prefix="moe-decode-")
    phases: dict = {}
    result = run_record("moe_decode_cpu", phases)
    try:
        model_dir = os.path.join(tmp, "model")
        with Phase(phases, "make_model"):
            make = [python, "-m", __spec__.name, "--make-model", model_dir, "--seed", str(args.seed)]
            subprocess.run(make, check=True, env=worker_env())
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(max(batches))]
        with Phase(phases, "hf_load"):
            hf = HF(python, model_dir, tmp)
        with Phase(phases, "ours_build"):
            ours = Ours(model_dir, max(batches))
        engines = {"ours": ours, "hf": hf}
        if args.also_ragged_dot:
            with Phase(phases, "ours_ragged_dot_build"):
                engines["ours_ragged_dot"] = Ours.with_ragged_dot(model_dir, max(batches))
        result["settings"] = {
            "model": MODEL,
            "num_params": ours.num_params(),
            "prompt_len": args.prompt_len,
            "batches": batches,
            "new_tokens": news,
            "repeats": args.repeats,
            "seed": args.seed,
        }
        for engine in engines.values():  # warm-up (excluded): every shape each side runs below
            for b, n in zip(batches, news, strict=True):
                engine.generate(prompts[:b], 1)
                engine.generate(prompts[:b], min(n, 4))
        result["batches"] = measure(engines, batches, news, prompts, args.repeats, phases)
        result["hf_info"] = hf.close()
        result["machine"]["loadavg_end"] = list(os.getloadavg())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_decode_cpu.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / "moe_decode_cpu.md")
    return result


if __name__ == "__main__":
    main()
