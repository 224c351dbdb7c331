"""Section `serve`: the headline table. `netra-jax serve` on the Llama-3.1-8B-shaped model (random bf16 weights, the
engine sized from the device by `engine_settings.sizing`), swept by `netra-jax bench serve`: the short sweep (1024
prompt / 256 output tokens) and the long one (8192 / 256), one closed-loop pass per user count, each cut at its
`Sweep.max_s`; output tok/s, TTFT and TPOT (median and p99) per pass.

The server loads the programs compiled for its device without it (`benchmarks/bundles/<target>-<variant>`,
`python -m benchmarks.gpu_check.bundles`) when they are there, and compiles the rest (all of them without a bundle)
in its warm-up before /ready; the dry run compiles a CPU bundle first and serves from it, so CI runs the same path.
`run_variant` serves another weight variant (section `serve_fp8`)."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check import engine_settings
from benchmarks.gpu_check.bundles import carried
from benchmarks.gpu_check.common import SERVER_PID, Section, Sweep, sig
from benchmarks.gpu_check.model_dir import ensure_model_dir

KEEP = (
    "completed",
    "failed",
    "cut",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
)


def one_level(url: str, sweep: Sweep, users: int, seconds: float) -> dict:
    """One closed-loop pass of `users` users over two rounds of requests, ended after `seconds`."""
    from netra_jax.bench import serve as bench

    flags = {
        "--base-url": url,
        "--max-concurrency": users,
        "--num-prompts": sweep.prompts(users),
        "--dataset": "random",
        "--input-len": sweep.input_len,
        "--output-len": sweep.output_len,
        "--seed": users,
        "--timeout": max(30.0, seconds + 30),
        "--max-duration": seconds,
    }
    argv = [str(x) for kv in flags.items() for x in kv] + ["--ignore-eos", "--disable-tqdm"]
    res = asyncio.run(bench.run(bench.parse_args(argv)))
    m = res["runs"][0]
    row = {k: sig(m[k]) if isinstance(m.get(k), float) else m.get(k) for k in KEEP}
    row["text_source"] = res["config"].get("text_source")
    if m.get("errors"):
        row["errors"] = m["errors"]
    return row


def cpu_bundle(sec: Section, model: Path, size: dict, quantization: str | None) -> tuple[Path | None, dict]:
    """The dry run's bundle: `netra-jax compile --target cpu` of the served configuration, in a process of its own
    (an executable read back from the persistent compilation cache does not serialize whole)."""
    out = sec.work / "bundles" / f"cpu-{quantization or 'bf16'}"
    cmd = [sys.executable, "-m", "netra_jax.cli", "compile", str(model), "--target", "cpu", "-o", str(out)]
    cmd += engine_settings.compile_flags(size, quantization)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(10.0, sec.left()))
    built = {"command": shlex.join(cmd[2:]), "seconds": sig(time.perf_counter() - t), "status": proc.returncode}
    if proc.returncode != 0:
        built["error"] = (proc.stderr or proc.stdout)[-600:]
        return None, built
    return out, built


def started(log: str) -> dict:
    """From the server's output: programs loaded from the bundle (and in how long), programs its warm-up compiled
    and how long that took, and the line naming what differs when the bundle did not match."""
    out: dict = {}
    if m := re.search(r"loaded (\d+) compiled programs from \S+ in ([\d.]+)s", log):
        out |= {"programs_loaded": int(m[1]), "load_s": float(m[2])}
    if m := re.search(r"warm-up done in ([\d.]+)s \((\d+) variants compiled\)", log):
        out |= {"warmup_s": float(m[1]), "programs_compiled": int(m[2])}
    if m := re.search(r"compiled programs in \S+ not used, compiling instead: (.*)", log):
        out["bundle_mismatch"] = m[1][:300]
    return out


def run_variant(sec: Section, variant: engine_settings.Variant) -> None:
    from netra_jax.bench.launch import launched

    path = ensure_model_dir(sec.work, sec.dry)
    target = sec.target()
    size = engine_settings.sizing(path, target, sec.dry, variant.quantization)
    sec.set("sizing", size | {"variant": variant.name})
    if sec.dry:
        compiled, built = cpu_bundle(sec, path, size, variant.quantization)
        sec.set("bundle_built", built)
    else:
        compiled = carried(target, variant.name)
    sec.set("bundle", str(compiled) if compiled else None)
    flags = engine_settings.serve_flags(size, True, str(compiled) if compiled else None, variant.quantization)
    server_args = shlex.join([str(path), *flags])
    sec.set("server_args", server_args)
    log = sec.work / f"{sec.name}.log"
    pid_file = sec.work / SERVER_PID  # the runner stops a server this process could not (killed at its limit)
    t = time.perf_counter()
    try:
        with launched(server_args, timeout=max(10.0, sec.left()), log_path=str(log), pid_file=str(pid_file)) as url:
            sec.set("time_to_ready_s", sig(time.perf_counter() - t))
            for sweep in sec.sizes.serve_sweeps:
                for users in sweep.users:
                    what = {"sweep": sweep.name, "input_len": sweep.input_len, "output_len": sweep.output_len}
                    what |= {"users": users, "prompts": sweep.prompts(users)}
                    seconds = min(sweep.max_s, sec.left() - 5)
                    level = functools.partial(one_level, url, sweep, users, seconds)
                    sec.attempt("levels", what, level, need_s=3 if sec.dry else 8)
        pid_file.unlink(missing_ok=True)  # stopped: nothing left for the runner to stop
    finally:
        if log.is_file():
            text = log.read_text(errors="replace")
            sec.set("start", started(text))
            sec.set("server_log_tail", text.splitlines()[-25:])


def run(sec: Section) -> None:
    run_variant(sec, engine_settings.VARIANTS[0])
