"""Start-up of the Python API: seconds for `LLM(model)` to return and for its first `generate` of a short prompt to
finish, in fresh processes, with a cold persistent compilation cache (an empty directory) and then warm (a second
process on the same directory), for the tiny-llama fixture and the default model (SmolLM2-135M-Instruct).

    .venv/bin/python benchmarks/startup.py                       # lazy LLM (the default), cold + warm, both models
    .venv/bin/python benchmarks/startup.py --modes lazy,warmup   # also LLM(warmup=True), as serve compiles
    .venv/bin/python benchmarks/startup.py --models tiny-llama --repeat 3

Each process imports netra_jax, builds `LLM(model, warmup=...)` with its defaults, then generates 16 greedy tokens
of one short prompt twice: the first call pays the compiles it needs, the second shows what is left without them.
Timings are taken inside the process (`import_s`, `construct_s`, `first_generate_s`, `second_generate_s`) and around
it (`process_s`: from the spawn to the child's exit). Each (model, mode, trial) gets its own cache root whose xla/
directory starts empty and whose converted parameters are the real cache's (loaded once first, so no timed start
converts weights): only the compilation cache is cold. The child also counts the XLA programs it compiled (jax's
compile log; persistent-cache hits included). Results go to benchmarks/results/<date>-startup[_<label>].json with
the machine and load averages (a shared machine is noisy: repeat)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from time_to_ready import fresh_cache_root

from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = Path(os.environ.get("NETRA_JAX_FIXTURES", ROOT.parent / "shared" / "fixtures"))
MODELS = {"tiny-llama": str(FIXTURES / "tiny-llama"), "smollm2": None}  # None: LLM's default model
PROMPT = "The capital of France is"

CHILD = r"""
import json, logging, sys, time
t0 = time.perf_counter()
names = []
class Log(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Finished XLA compilation of jit("):
            names.append(record.getMessage().split("(")[1].split(")")[0])
import jax
from netra_jax import LLM, SamplingParams
logging.getLogger("jax._src.dispatch").addHandler(Log())
jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").setLevel(logging.WARNING)
a = json.loads(sys.argv[1])
t1 = time.perf_counter()
llm = LLM(a["model"], warmup=a["warmup"])
t2 = time.perf_counter()
compiled_by_construct = len(names)
sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
out = llm.generate(a["prompt"], sp, use_tqdm=False)
t3 = time.perf_counter()
llm.generate(a["prompt"], sp, use_tqdm=False)
t4 = time.perf_counter()
print("RESULT " + json.dumps({
    "import_s": round(t1 - t0, 3), "construct_s": round(t2 - t1, 3), "first_generate_s": round(t3 - t2, 3),
    "second_generate_s": round(t4 - t3, 3), "to_first_output_s": round(t3 - t1, 3),
    "programs_compiled_constructing": compiled_by_construct, "programs_compiled": len(names),
    "steps_compiled": names.count("_step"), "output_tokens": len(out[0].outputs[0].token_ids),
}), flush=True)
"""


def prime_parameter_cache(model: str | None, env: dict) -> None:
    """Load the model once in another process, so that no timed start converts its weights."""
    code = (
        "import sys; from netra_jax.engine.factory import resolve_model_path; from netra_jax.loader import load_model; "
    )
    code += "load_model(resolve_model_path(sys.argv[1] or None))"
    subprocess.run([sys.executable, "-c", code, model or ""], env=env, check=True, capture_output=True)


def run_child(model: str | None, warmup: bool, cache_root: Path, env: dict, timeout: float) -> dict:
    env = {**env, "NETRA_JAX_CACHE": str(cache_root)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    arg = json.dumps({"model": model, "warmup": warmup, "prompt": PROMPT})
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT)
    )
    process_s = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT ") :])
    out.update(process_s=round(process_s, 2), loadavg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--modes", default="lazy", help="comma-separated: lazy (LLM's default) and/or warmup")
    p.add_argument("--repeat", type=int, default=1, help="cold + warm pairs per model and mode")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one process may take")
    p.add_argument("--label", default=None, help="suffix of the result file name")
    p.add_argument("--out", default=None, help="result JSON path (default benchmarks/results/<date>-startup.json)")
    a = p.parse_args(argv)
    models = a.models.split(",")
    modes = a.modes.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(modes) - {"lazy", "warmup"})
    if unknown:
        p.error(f"unknown model or mode: {', '.join(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    env = dict(os.environ)
    for name in models:
        prime_parameter_cache(MODELS[name], env)
    runs = []
    for name in models:
        for mode in modes:
            for trial in range(a.repeat):
                cache = fresh_cache_root(work)
                for kind in ("cold", "warm"):
                    r = run_child(MODELS[name], mode == "warmup", cache, env, a.timeout)
                    r.update(model=name, mode=mode, cache=kind, trial=trial)
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    summary = {}
    for name in models:
        for mode in modes:
            for kind in ("cold", "warm"):
                rs = [r for r in runs if (r["model"], r["mode"], r["cache"]) == (name, mode, kind)]
                summary[f"{name}/{mode}/{kind}"] = {
                    key + "_min": min(r[key] for r in rs)
                    for key in ("construct_s", "first_generate_s", "to_first_output_s", "process_s")
                } | {"n": len(rs)}
    result = {
        "benchmark": "startup",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_rev": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "prompt": PROMPT,
        "max_tokens": 16,
        "machine": machine_info(),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=1), flush=True)
    write_result(result, f"startup{'_' + a.label if a.label else ''}", RESULTS, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
