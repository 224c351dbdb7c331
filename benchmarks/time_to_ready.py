"""Time to ready with a cold persistent compilation cache (a fresh directory) and then warm (a second start on it), each
start a fresh process: of `netra-jax serve` (seconds to the first 200 on /health and on /ready) and of the Python API
(`LLM(model)` and its first `generate`).

    .venv/bin/python -m benchmarks.time_to_ready                  # serve: one cold + one warm start, quiet
    .venv/bin/python -m benchmarks.time_to_ready --repeat 3 --load   # three pairs, another process burning a core
    .venv/bin/python -m benchmarks.time_to_ready --git-rev 6ed6173 --label before   # an older commit, same harness
    .venv/bin/python -m benchmarks.time_to_ready --what llm       # LLM(model), lazy (its default), both models
    .venv/bin/python -m benchmarks.time_to_ready --what llm --modes lazy,warmup --models tiny-llama --repeat 3
    .venv/bin/python -m benchmarks.time_to_ready --what both --result-dir DIR

Each cold + warm pair gets its own cache root ($NETRA_JAX_CACHE) holding a fresh xla/ directory and links to the real
cache's default model, converted parameters and C++ CPU kernels (each model loaded once first, so that no timed start
converts its weights; the kernels are built at install): only the compilation cache is cold (--cold-kernels: and the
kernels unbuilt). Right after /ready each start sends a one-token completion (and one per adapter with --lora N,
which serves N random rank-8 adapters) and records its seconds and the compilations on the request path.
serve (the default): `netra-jax serve` on the default model (--server-args adds flags or names another model). While
a server warms up, /health must answer 200 and /ready 503 (recorded as probe counts). Results go to
benchmarks/results/<date>-time_to_ready[_<label>].json.
llm: a process imports netra_jax, builds `LLM(model, warmup=...)` with its defaults (--modes: lazy, LLM's default,
and/or warmup, compiling everything as serve does), then generates 16 greedy tokens of one short prompt twice: the
first call pays the compiles it needs, the second shows what is left without them. Timings are taken inside the
process (`import_s`, `construct_s`, `first_generate_s`, `second_generate_s`) and around it (`process_s`: from the
spawn to the child's exit); the child also counts the XLA programs it compiled (jax's compile log; persistent-cache
hits included). --models: the tiny-llama fixture and the default model (smollm2). Results go to
benchmarks/results/<date>-startup[_<label>].json.
Every result has the machine's description and load averages (starts on a shared machine are noisy: repeat)."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from netra_jax.assets import cache_dir
from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = Path(os.environ.get("NETRA_JAX_FIXTURES", ROOT.parent / "shared" / "fixtures"))
MODELS = {"tiny-llama": str(FIXTURES / "tiny-llama"), "smollm2": None}  # None: LLM's default model
MODES = ("lazy", "warmup")
PROMPT = "The capital of France is"
POLL_S = 0.1

# the `llm` start: import, LLM(model), two generates, and the XLA programs compiled meanwhile
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


# ---------------------------------------------------------------------------------------------------- both kinds
def fresh_cache_root(parent: Path, kernels: bool = True) -> Path:
    """A cache root whose xla/ is empty and whose model and parameter caches are the real ones (linked), and the C++
    CPU kernels' build too unless `kernels` is False (they are built at install, `make setup`; a start without them
    builds them first)."""
    root = Path(tempfile.mkdtemp(prefix="ttr-cache-", dir=parent))
    for name in ("smollm2", "params", *(["kernels"] if kernels else [])):
        src = cache_dir() / name
        if src.exists():
            (root / name).symlink_to(src, target_is_directory=True)
    return root


def start_env(env: dict, cache_root: Path) -> dict:
    """`env` for a timed start on `cache_root`: its own persistent compilation cache, output unbuffered."""
    env = {**env, "NETRA_JAX_CACHE": str(cache_root), "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def source_tree(rev: str, parent: Path) -> Path:
    """`git archive` of `rev` unpacked under `parent`, laid out as the installed package maps it (models/ and
    serving/ are the subpackages netra_jax.models and netra_jax.serving), for PYTHONPATH."""
    out = parent / f"src-{rev}"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        tf.extractall(out, filter="data")
    for sub in ("models", "serving"):
        (out / "netra_jax" / sub).symlink_to(out / sub, target_is_directory=True)
    return out


def head_rev() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def prime_parameter_cache(model: str | None, env: dict, cwd: Path) -> None:
    """Load `model` (None: the default one) once in a separate process, so that no timed start converts its weights
    (a start after a change of the loader's code would otherwise convert them and be slower for that alone)."""
    code = "import sys; from netra_jax.engine.factory import resolve_model_path; "
    code += "from netra_jax.loader import load_model; load_model(resolve_model_path(sys.argv[1] or None))"
    subprocess.run([sys.executable, "-c", code, model or ""], env=env, cwd=str(cwd), check=True, capture_output=True)


def cold_warm(
    work: Path, repeat: int, start: Callable[[Path, str], dict], kernels: bool = True, **labels
) -> list[dict]:
    """`repeat` pairs of starts, each pair on a fresh cache root: cold (its xla/ empty), then warm (the same root);
    every start's record gets `labels`, its trial and its cache, and is printed."""
    runs = []
    for trial in range(repeat):
        cache = fresh_cache_root(work, kernels)
        for kind in ("cold", "warm"):
            r = start(cache, f"{trial}-{kind}")
            r.update(labels, trial=trial, cache=kind)
            runs.append(r)
            print(json.dumps(r), flush=True)
    return runs


# ---------------------------------------------------------------------------------------------------- serve
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None  # not listening yet


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used so far; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def post_seconds(url: str, body: dict) -> float:
    """Seconds a POST of JSON `body` takes to answer 200 (RuntimeError otherwise)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status}")
        r.read()
    return time.monotonic() - t0


def metric(base: str, name: str) -> float | None:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        m = re.search(rf"^{name} ([\d.e+-]+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else None


def first_requests(base: str, adapters: list[str]) -> dict:
    """Right after /ready: seconds to a one-token completion of PROMPT (its first token), then each adapter's first
    one; the compilations on the request path meanwhile (`netra_xla_compilations_outside_warmup`) and the programs
    still compiling in the background."""
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        served = next(m["id"] for m in json.loads(r.read())["data"] if not m.get("parent"))
    before = metric(base, "netra_xla_compilations_outside_warmup")
    out = {"first_token_after_ready_s": round(post_seconds(base + "/v1/completions", _one_token(served)), 3)}
    if adapters:
        out["adapter_first_token_s"] = {
            a: round(post_seconds(base + "/v1/completions", _one_token(a)), 3) for a in adapters
        }
    after = metric(base, "netra_xla_compilations_outside_warmup")
    out["request_path_compiles"] = None if before is None or after is None else int(after - before)
    out["programs_pending_after"] = metric(base, "netra_programs_pending")
    return out


def _one_token(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}


def random_adapters(work: Path, n: int, rank: int = 8) -> list[str]:
    """`n` PEFT adapters of rank `rank` on every projection of the default model, random factors
    (`benchmarks.step_profile.lora.random_adapters`), written under `work`; their `--lora-modules` arguments."""
    from benchmarks.step_profile.lora import random_adapters as adapters
    from netra_jax.engine.factory import resolve_model_path
    from netra_jax.loader import load_config
    from netra_jax.models.lora import save_peft_adapter

    cfg = load_config(resolve_model_path(None))
    return [f"{a.name}={save_peft_adapter(a, work / a.name)}" for a in adapters(cfg, n, rank)]


def start_once(cache_root: Path, server_args: list[str], env: dict, timeout: float, log_dir: Path, tag: str) -> dict:
    """One start: seconds to the first /health 200 and /ready 200, the CPU seconds the server had used by then
    (less sensitive than wall time to other work on the machine), the probe answers seen during warm-up, what the
    server printed about loading and warm-up, and its first requests after /ready (`first_requests`)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = log_dir / f"{tag}.log"
    cmd = [sys.executable, "-m", "netra_jax.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *server_args]
    env = start_env(env, cache_root)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir))
    out = {"health_s": None, "ready_s": None, "probes_while_warming": {"health_200": 0, "health_other": 0}}
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            health = status(base + "/health")
            now = time.monotonic() - t0
            if health == 200 and out["health_s"] is None:
                out["health_s"] = round(now, 2)
            if health is not None:
                ready = status(base + "/ready")
                if ready == 200:
                    out["ready_s"] = round(time.monotonic() - t0, 2)
                    cpu = cpu_seconds(proc.pid)
                    out["cpu_s_to_ready"] = None if cpu is None else round(cpu, 1)
                    adapters = [m.split("=", 1)[0] for m in _lora_modules(server_args)]
                    out.update(first_requests(base, adapters))
                    break
                key = "health_200" if health == 200 else "health_other"
                out["probes_while_warming"][key] += 1
            time.sleep(POLL_S)
        else:
            raise RuntimeError(f"not ready after {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    loaded = re.search(r"loaded .* in ([\d.]+)s", text)
    warm = re.search(r"warm-up done in ([\d.]+)s(?: \((\d+) variants)?", text)
    out["load_s"] = float(loaded.group(1)) if loaded else None
    out["warmup_s"] = float(warm.group(1)) if warm else None
    out["variants"] = int(warm.group(2)) if warm and warm.group(2) else None
    out["loadavg_1m"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    return out


def _lora_modules(server_args: list[str]) -> list[str]:
    """The NAME=PATH arguments after --lora-modules."""
    if "--lora-modules" not in server_args:
        return []
    rest = server_args[server_args.index("--lora-modules") + 1 :]
    return [a for a in rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))] if "=" in a]


def serve_summary(runs: list[dict]) -> dict:
    summary = {}
    for kind in ("cold", "warm"):
        ready = [r["ready_s"] for r in runs if r["cache"] == kind]
        cpu = [r["cpu_s_to_ready"] for r in runs if r["cache"] == kind and r["cpu_s_to_ready"] is not None]
        first = [r["first_token_after_ready_s"] for r in runs if r["cache"] == kind]
        summary[kind] = {
            "ready_s_min": min(ready),
            "ready_s_max": max(ready),
            "first_token_after_ready_s_max": max(first),
            "cpu_s_to_ready_min": min(cpu, default=None),
            "n": len(ready),
        }
    return summary


# ---------------------------------------------------------------------------------------------------- llm
def llm_start(model: str | None, warmup: bool, cache_root: Path, env: dict, timeout: float, cwd: Path) -> dict:
    """One `LLM(model)` start and its two generates in a fresh process (CHILD)."""
    arg = json.dumps({"model": model, "warmup": warmup, "prompt": PROMPT})
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, arg],
        env=start_env(env, cache_root),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd),
    )
    process_s = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT ") :])
    out.update(process_s=round(process_s, 2), loadavg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
    return out


def llm_summary(runs: list[dict], models: list[str], modes: list[str]) -> dict:
    summary = {}
    for name in models:
        for mode in modes:
            for kind in ("cold", "warm"):
                rs = [r for r in runs if (r["model"], r["mode"], r["cache"]) == (name, mode, kind)]
                summary[f"{name}/{mode}/{kind}"] = {
                    key + "_min": min(r[key] for r in rs)
                    for key in ("construct_s", "first_generate_s", "to_first_output_s", "process_s")
                } | {"n": len(rs)}
    return summary


# ---------------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_ready",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--what", choices=("serve", "llm", "both"), default="serve", help="which start to time")
    p.add_argument("--repeat", type=int, default=1, help="cold + warm pairs (each with its own fresh cache)")
    p.add_argument("--load", action="store_true", help="keep another process burning one core meanwhile")
    p.add_argument("--git-rev", default=None, help="run netra_jax from this commit (git archive) instead")
    p.add_argument("--label", default=None, help="suffix of the result file names")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take")
    p.add_argument("--out", default=None, help="result JSON path of --what serve or llm (default: in --result-dir)")
    p.add_argument("--result-dir", type=Path, default=RESULTS, help="where results go by their default names")
    serve = p.add_argument_group("serve")
    serve.add_argument("--server-args", default="", help="extra `netra-jax serve` flags, one shell-quoted string")
    p.add_argument(
        "--cold-kernels", action="store_true", help="cold starts build the C++ CPU kernels too (as before make setup)"
    )
    serve.add_argument(
        "--lora", type=int, default=0, help="serve this many random rank-8 adapters (--enable-lora --lora-modules)"
    )
    llm = p.add_argument_group("llm")
    llm.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    llm.add_argument("--modes", default="lazy", help="comma-separated: lazy (LLM's default) and/or warmup")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    kinds = ("serve", "llm") if a.what == "both" else (a.what,)
    models, modes = a.models.split(","), a.modes.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(modes) - set(MODES))
    if "llm" in kinds and unknown:
        p.error(f"unknown model or mode: {', '.join(unknown)}")
    if a.out and len(kinds) > 1:
        p.error("--out names one result file: with --what both, use --result-dir (and --label)")
    work = Path(tempfile.mkdtemp(prefix="time-to-ready-"))
    env = dict(os.environ)
    if a.git_rev:
        env["PYTHONPATH"] = str(source_tree(a.git_rev, work))
    primed = ([None] if "serve" in kinds else []) + ([MODELS[m] for m in models] if "llm" in kinds else [])
    for model in dict.fromkeys(primed):
        prime_parameter_cache(model, env, work)
    burner = None
    if a.load:
        burner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    docs = {}
    try:
        if "serve" in kinds:
            server_args = shlex.split(a.server_args)
            if a.lora:
                modules = random_adapters(work, a.lora)
                server_args += ["--enable-lora", "--max-loras", str(a.lora), "--lora-modules", *modules]
            runs = cold_warm(
                work,
                a.repeat,
                lambda cache, tag: start_once(cache, server_args, env, a.timeout, work, tag),
                not a.cold_kernels,
            )
            args_text = shlex.join(server_args)
            docs["time_to_ready"] = {"server_args": args_text, "summary": serve_summary(runs), "runs": runs}
        if "llm" in kinds:
            runs = []
            for name in models:
                for mode in modes:
                    model, warmup = MODELS[name], mode == "warmup"
                    runs += cold_warm(
                        work,
                        a.repeat,
                        lambda cache, tag, m=model, w=warmup: llm_start(m, w, cache, env, a.timeout, work),
                        model=name,
                        mode=mode,
                    )
            summary = llm_summary(runs, models, modes)
            docs["startup"] = {"prompt": PROMPT, "max_tokens": 16, "summary": summary, "runs": runs}
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    for benchmark, fields in docs.items():
        result = {
            "benchmark": benchmark,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git_rev": a.git_rev or head_rev(),
            "load": "one extra process burning a core" if a.load else "none added",
            "machine": machine_info(),
            **fields,
        }
        print(json.dumps(result["summary"]), flush=True)
        write_result(result, f"{benchmark}{'_' + a.label if a.label else ''}", a.result_dir, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
