"""Offline throughput: 64 chat prompts x 128 greedy tokens through `LLM.generate` (float32), against Hugging Face
`generate` on the same weights and prompts in the same run, with matmul-peak and memory-bandwidth roofline lines.

Usage: `.venv/bin/python -m benchmarks.offline_throughput [--quick] [--model PATH] [--no-hf] [--out FILE]` (or `make
bench-offline`).
Writes benchmarks/results/<date>-offline_throughput.json and .png (benchmarks/offline_report.py) and prints a table.
The machine's peaks, the step's costs and its profile come from `benchmarks.step_profile.roofline`.

The Hugging Face baseline needs torch + transformers + gguf + accelerate. On these machines a CPU build of
torch 2.13.0 exists on disk for Python 3.11 only (for 3.12 pip would fetch a multi-GB CUDA build), so the baseline
runs in a separate Python 3.11 virtual environment, started by this script as a subprocess (the same module, with
`--hf-worker`) that gets the prompt token ids through a JSON file:

    /root/.pyenv/versions/3.11.7/bin/python -m venv ~/.cache/netra_jax/hfvenv
    ~/.cache/netra_jax/hfvenv/bin/pip install torch==2.13.0 transformers gguf accelerate numpy

Its interpreter is taken from `--hf-python`, else $NETRA_HF_PYTHON, else benchmarks/.hfvenv, else
$NETRA_JAX_CACHE (default ~/.cache/netra_jax)/hfvenv, else the current interpreter if it imports torch and
transformers. The GGUF file is loaded by transformers' GGUF loader (de-quantized to float32), the same weights
our loader produces. Checked with torch 2.13.0+cpu, transformers 5.24.0, gguf 0.19.0, accelerate 1.15.0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import offline_report
from benchmarks.hf_baseline import BaselineWorker, find_hf_python, load_model
from benchmarks.hf_baseline import start_worker as _start_worker
from benchmarks.phases import QUIET_CORES, Phase, run_record
from benchmarks.step_profile import roofline as rl

HERE = Path(__file__).resolve().parent

SUBJECTS = [
    "photosynthesis",
    "gravity",
    "a black hole",
    "the water cycle",
    "inflation",
    "a prime number",
    "DNA",
    "the Roman Empire",
    "machine learning",
    "a volcano",
    "the stock market",
    "democracy",
    "an atom",
    "a rainbow",
    "the internet",
    "climate change",
    "a vaccine",
    "the moon",
    "electricity",
    "a galaxy",
    "recycling",
    "jazz music",
    "the French Revolution",
    "a computer virus",
    "an earthquake",
    "the immune system",
    "a hurricane",
    "chess",
    "the Pythagorean theorem",
    "coffee",
    "the Great Wall of China",
    "a honeybee colony",
]
FORMS = ["What is {}? Answer briefly.", "Explain {} to a ten-year-old."]


def questions(n: int) -> list[str]:
    """n distinct short user questions, deterministic (subjects x forms)."""
    out = [f.format(s) for f in FORMS for s in SUBJECTS]
    if n > len(out):
        out += [f"Tell me fact number {i} about {SUBJECTS[i % len(SUBJECTS)]}." for i in range(n - len(out))]
    return out[:n]


def summarize(runs: list[dict], batch: int, max_tokens: int) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {
        "batch": batch,
        "max_tokens": max_tokens,
        "repeats": len(runs),
        "median": med,
        "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in runs],
    }


# ---------------------------------------------------------------------------------------------------- ours
class Ours:
    """Our engine: built with every bucket compiled, warmed up by a short generate, then timed run by run."""

    def __init__(self, args, prompt_ids: list[list[int]], phases: dict):
        import jax

        from netra_jax import LLM

        self.args, self.prompt_ids = args, prompt_ids
        with Phase(phases, "ours_build") as ph:
            self.llm = LLM(
                args.model,
                dtype=args.dtype,
                max_num_seqs=len(prompt_ids),
                max_num_batched_tokens=args.max_num_batched_tokens,
                warmup=True,
            )
        self.info = {
            "build_s": ph.rec["wall_s"],
            "backend": getattr(self.llm.engine.runner, "backend", None),
            "jax_backend": jax.default_backend(),
        }
        self.prompts = [{"prompt_token_ids": p} for p in prompt_ids]
        self.output_ids: list[list[int]] = []
        with Phase(phases, "ours_warmup_generate"):
            for ps in (self.prompts, self.prompts[:1]):
                self.generate(ps, 4)

    def reset_cache(self) -> None:
        pool = self.llm.engine.pool
        if hasattr(pool, "reset_prefix_cache"):
            pool.reset_prefix_cache()  # every run computes its prompts in full, as HF does

    def generate(self, ps, max_tokens: int):
        from netra_jax import SamplingParams

        self.reset_cache()
        return self.llm.generate(
            ps, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False
        )

    def run(self, name: str) -> dict:
        ps, n = (self.prompts, self.args.max_tokens) if name == "batch" else (self.prompts[:1], self.args.batch1_tokens)
        w0, t0 = time.time(), time.perf_counter()
        outs = self.generate(ps, n)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == len(ps) * n, f"expected {len(ps) * n} tokens, got {n_out}"
        prefill = max(o.metrics.first_token_time for o in outs) - w0  # until every request has its first token
        if name == "batch":
            self.output_ids = [list(o.outputs[0].token_ids) for o in outs]
        return {
            "total_s": dt,
            "tok_s": n_out / dt,
            "prefill_s": prefill,
            "decode_tok_s": (n_out - len(ps)) / max(dt - prefill, 1e-9),
        }

    def profile(self) -> dict:
        out = {}
        lens = [len(p) for p in self.prompt_ids]
        for name, ps, n, ctx in (
            ("batch", self.prompts, self.args.max_tokens, statistics.mean(lens)),
            ("batch1", self.prompts[:1], self.args.batch1_tokens, lens[0]),
        ):
            out[name] = rl.profile_steps(self.llm, ps, n, self.reset_cache)
            try:
                out[name]["components"] = rl.component_times(self.llm, len(ps), int(ctx + n / 2), self.args.repeats)
            except Exception as e:  # internals moved: keep the rest of the report
                out[name]["components"] = {"error": repr(e)}
        out["matmul_shapes"] = rl.decode_matmul_shapes(self.llm.model_config, len(self.prompts), self.args.repeats + 2)
        return out


# ---------------------------------------------------------------------------------------------------- Hugging Face
def hf_worker(inp: str) -> None:
    """Runs in the baseline interpreter: load the same weights with transformers, warm up, then answer one JSON
    line per command on stdin ("batch" / "batch1" time one greedy generate; "quit" returns info and output ids)."""
    import torch
    import transformers

    job = json.loads(Path(inp).read_text())
    torch.set_num_threads(job.get("threads") or os.cpu_count())
    t0 = time.perf_counter()
    model = load_model(job["model"])
    info = {
        "load_s": time.perf_counter() - t0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    pad, eos = job["pad_id"], job["eos_ids"]
    last: dict = {}

    def gen(prompts, n):
        L = max(len(p) for p in prompts)  # left padding
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                eos_token_id=eos,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        dt = time.perf_counter() - t0
        assert out.shape[1] == L + n, out.shape
        if len(prompts) > 1:
            last["ids"] = out[:, L:].tolist()
        return {"total_s": dt, "tok_s": len(prompts) * n / dt}

    gen(job["prompt_ids"], 2)
    gen(job["prompt_ids"][:1], 2)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            print(json.dumps({"info": info, "output_ids": last.get("ids")}), flush=True)
            return
        batch = cmd == "batch"
        ps = job["prompt_ids"] if batch else job["prompt_ids"][:1]
        print(json.dumps(gen(ps, job["max_tokens"] if batch else job["batch1_tokens"])), flush=True)


def start_worker(python: str, module: str, arg: str, stderr) -> subprocess.Popen:
    """`python -m module --hf-worker arg` offline, talking JSON lines over stdin/stdout; its CPU time counts as ours."""
    proc = _start_worker(python, module, arg, stderr)
    Phase.children.append(proc.pid)
    return proc


class HFClient(BaselineWorker):
    """The generate baseline's worker: `wait_ready` once its model has loaded, then `run("batch")` or
    `run("batch1")`."""

    def __init__(self, args, hf_python: str, prompt_ids, eos_ids: list[int]):
        job = {
            "model": str(args.model),
            "prompt_ids": prompt_ids,
            "max_tokens": args.max_tokens,
            "batch1_tokens": args.batch1_tokens,
            "pad_id": eos_ids[0],
            "eos_ids": eos_ids,
        }
        super().__init__(hf_python, __spec__.name, job)  # this module, by the name `python -m` runs it
        Phase.children.append(self.proc.pid)

    def wait_ready(self) -> None:
        self.ask(None)

    def run(self, name: str) -> dict:
        return self.ask(name)


def agreement(ours: list[list[int]], hf: list[list[int]], eos_ids: list[int]) -> dict:
    """Greedy agreement, compared up to our first EOS (HF's min_new_tokens forbids EOS; ignore_eos does not)."""
    same, prefix = 0, []
    for a, b in zip(ours, hf, strict=True):
        cut = next((i for i, t in enumerate(a) if t in eos_ids), len(a))
        n = next((i for i, (x, y) in enumerate(zip(a[:cut], b[:cut], strict=False)) if x != y), cut)
        same += n == cut
        prefix.append(n)
    return {"identical_until_eos": same, "of": len(ours), "mean_common_prefix": statistics.mean(prefix)}


# ---------------------------------------------------------------------------------------------------- report
def figures(cfg, itemsize: int, prompt_ids, args, peaks: dict, ours: dict, hf: dict | None) -> dict:
    """The headline numbers: tok/s, ours/HF ratios, fractions of the matmul peak and of the batch-1 bandwidth
    roofline, from the median runs (`ours` / `hf` hold `batch` and `batch1` summaries)."""
    peak, bw = peaks["matmul_peak_gflops"] * 1e9, peaks["bandwidth_gbs"] * 1e9
    lens = [len(p) for p in prompt_ids]
    n = args.max_tokens
    ctx = statistics.mean(lens) + n / 2  # mean context of the decode tokens
    fpt = rl.flops_per_token(cfg, ctx)
    attn1 = rl.attention_flops_per_token(cfg, 1.0)  # per key (full-attention layers)
    run_flops = sum((L + n - 1) * 2.0 * rl.matmul_params(cfg) + attn1 * (L + n - 1) * (L + n) / 2 for L in lens)
    ob, o1 = ours["batch"]["median"], ours["batch1"]["median"]
    ctx1 = lens[0] + args.batch1_tokens / 2
    bytes1 = rl.weight_bytes(cfg, itemsize) + rl.kv_bytes_per_token(cfg, ctx1, itemsize)
    f = {
        "costs_batch": rl.decode_step_costs(cfg, len(prompt_ids), ctx, itemsize),
        "costs_batch1": rl.decode_step_costs(cfg, 1, ctx1, itemsize),
        "ours_tok_s": ob["tok_s"],
        "ours_total_s": ob["total_s"],
        "ours_decode_tok_s": ob["decode_tok_s"],
        "ours_prefill_s": ob["prefill_s"],
        "ours_frac_peak": ob["tok_s"] * fpt / peak,
        "ours_frac_peak_decode_only": ob["decode_tok_s"] * fpt / peak,
        "ours_frac_peak_all_flops": run_flops / ob["total_s"] / peak,
        "ours_batch1_tok_s": o1["tok_s"],
        "ours_batch1_decode_tok_s": o1["decode_tok_s"],
        "batch1_roofline_tok_s": bw / bytes1,
        "ours_batch1_frac_roofline": o1["decode_tok_s"] / (bw / bytes1),
    }
    if hf and "batch" in hf:
        hb, h1 = hf["batch"]["median"], hf["batch1"]["median"]
        f.update(
            hf_tok_s=hb["tok_s"],
            hf_total_s=hb["total_s"],
            ratio=ob["tok_s"] / hb["tok_s"],
            hf_frac_peak=hb["tok_s"] * fpt / peak,
            hf_frac_peak_all_flops=run_flops / hb["total_s"] / peak,
            hf_batch1_tok_s=h1["tok_s"],
            ratio_batch1=o1["tok_s"] / h1["tok_s"],
            hf_batch1_frac_roofline=h1["tok_s"] / (bw / bytes1),
        )
        if hf["batch"].get("paired_ratios"):
            f["ratio_paired_median"] = statistics.median(hf["batch"]["paired_ratios"])
        for name in ("batch", "batch1"):  # pairs in which other processes used under QUIET_CORES
            quiet = [
                (o["tok_s"], h["tok_s"])
                for o, h in zip(ours[name]["runs"], hf[name]["runs"], strict=False)
                if max(o.get("others_cores") or 0, h.get("others_cores") or 0) < QUIET_CORES
            ]
            f[f"quiet_pairs_{name}"] = len(quiet)
            if quiet:
                f[f"ours_tok_s_quiet_{name}"] = statistics.median(o for o, _ in quiet)
                f[f"hf_tok_s_quiet_{name}"] = statistics.median(h for _, h in quiet)
                f[f"ratio_quiet_{name}"] = statistics.median(o / h for o, h in quiet)
    return f


def measure_peaks(args, phases: dict, name: str, max_wait_s: float = 120.0) -> list[dict]:
    """Peak readings, retried (every 10 s, for up to `max_wait_s`) until one is taken while the machine is quiet."""
    readings, t0 = [], time.perf_counter()
    while True:
        with Phase(phases, f"{name}_{len(readings)}") as ph:
            readings.append(dict(rl.measure_peaks(args.quick), others_cores=None))
        readings[-1]["others_cores"] = ph.rec["others_cores"]
        if args.quick or ph.rec["others_cores"] < QUIET_CORES or time.perf_counter() - t0 > max_wait_s:
            return readings
        time.sleep(10)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats of each run (default 3, quick 1)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: 4 prompts x 8 tokens, small peak tests")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--hf-python", default=None, help="interpreter with torch + transformers for the baseline")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/<date>-...json)")
    ap.add_argument("--hf-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hf_worker:
        hf_worker(args.hf_worker)
        return {}
    if args.quick:
        args.num_prompts, args.max_tokens, args.batch1_tokens = 4, 8, 4
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 256)
    args.repeats = args.repeats or (1 if args.quick else 3)

    from netra_jax.engine.factory import resolve_model_path
    from netra_jax.tokenization.tokenizer import Tokenizer

    args.model = resolve_model_path(args.model)
    phases: dict = {}
    result = run_record("offline_throughput", phases)
    tok = Tokenizer.load(args.model)
    convs = [[{"role": "user", "content": q}] for q in questions(args.num_prompts)]
    prompt_ids = [
        tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False) for c in convs
    ]
    result["settings"] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "batch1_tokens": args.batch1_tokens,
        "max_num_seqs": args.num_prompts,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "repeats": args.repeats,
        "quick": args.quick,
        "temperature": 0,
        "ignore_eos": True,
        "prompt_lens": [len(p) for p in prompt_ids],
        "questions": questions(args.num_prompts),
    }
    peaks = measure_peaks(args, phases, "peaks_before")
    eos = list(tok.eos_token_ids or [])
    hf_python = None if args.no_hf else find_hf_python(args.hf_python)
    hf_client = HFClient(args, hf_python, prompt_ids, eos or [0]) if hf_python else None  # loads meanwhile
    ours = Ours(args, prompt_ids, phases)
    hf: dict | None = None if args.no_hf else {"error": "no interpreter with torch + transformers found"}
    try:
        if hf_client:
            with Phase(phases, "hf_load_and_warmup"):
                hf_client.wait_ready()
        runs: dict = {}
        for name in ("batch", "batch1"):
            for i in range(args.repeats):  # paired runs, alternating who goes first, under the same load
                order = [("ours", ours), ("hf", hf_client)] if i % 2 == 0 else [("hf", hf_client), ("ours", ours)]
                for who, eng in order:
                    if eng is None:
                        continue
                    with Phase(phases, f"{who}_{name}_{i}") as ph:
                        r = eng.run(name)
                    runs.setdefault((who, name), []).append(
                        dict(r, load1=ph.rec["load1"], others_cores=ph.rec["others_cores"])
                    )
        if hf_client:
            hf = hf_client.close()
            hf_client = None
            result["agreement"] = agreement(ours.output_ids, hf.pop("output_ids"), eos)
            for name in ("batch", "batch1"):
                hf[name] = summarize(
                    runs[("hf", name)],
                    len(prompt_ids) if name == "batch" else 1,
                    args.max_tokens if name == "batch" else args.batch1_tokens,
                )
                pairs = zip(runs[("ours", name)], runs[("hf", name)], strict=True)
                hf[name]["paired_ratios"] = [round(o["tok_s"] / h["tok_s"], 3) for o, h in pairs]
    except RuntimeError as e:
        hf = {"error": str(e)}
    finally:
        if hf_client:
            hf_client.proc.kill()
    res_ours = dict(ours.info)
    for name in ("batch", "batch1"):
        res_ours[name] = summarize(
            runs[("ours", name)],
            len(prompt_ids) if name == "batch" else 1,
            args.max_tokens if name == "batch" else args.batch1_tokens,
        )
    if args.profile:
        with Phase(phases, "ours_profile"):
            res_ours["profile"] = ours.profile()
    peaks += measure_peaks(args, phases, "peaks_after")
    best = max(peaks, key=lambda p: p["matmul_peak_gflops"])
    result["peaks"] = dict(best, bandwidth_gbs=max(p["bandwidth_gbs"] for p in peaks), readings=peaks)
    result["ours"], result["hf"] = res_ours, hf
    cfg = ours.llm.model_config
    itemsize = 2 if args.dtype == "bfloat16" else 4
    result["figures"] = figures(cfg, itemsize, prompt_ids, args, result["peaks"], res_ours, hf)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    day = datetime.date.today().isoformat()
    name = f"{day}-offline_throughput{'-quick' if args.quick else ''}.json"
    out = Path(args.out) if args.out else HERE / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    offline_report.print_table(result)
    print(f"wrote {out}")
    try:  # the plot next to the JSON (matplotlib is in the bench extra)
        print(f"wrote {offline_report.plot(result, out.with_suffix('.png'))}")
    except ImportError as e:
        print(f"no plot: {e}")
    return result


if __name__ == "__main__":
    main()
