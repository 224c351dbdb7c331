"""Runs the GPU check's sections in order, each in its own process (a crash or a hung compile loses one section, GPU
memory is freed between them, the torch peers never share a process with JAX), each under its own time budget, and
merges their results into RESULTS_DIR/<date>-gpu_check-<device>.json and .md after every section.

Usage: python -m benchmarks.gpu_check RESULTS_DIR [--dry-run] [--budget SECONDS] [--sections a,b,...] (the netra_jax
layout and the benchmarks package on the path: benchmarks/gpu_check.sh sets them up)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_check import report
from benchmarks.gpu_check.common import SERVER_PID
from netra_jax.engine.runner import FRACTION_ENV

# name, seconds on the device, seconds in the dry run, what it needs (jax: a JAX process with its memory fraction;
# client: it launches a server). The headline first: the serving sweeps of the 8B model in bf16, then in fp8, then
# batch-1 decode and the step's profile, then the kernels' sections with what is left (unused time rolls forward).
SECTIONS = (
    ("device", 15, 10, "jax"),
    ("serve", 230, 100, "client"),  # the dry run's first bundle compile builds the C++ CPU kernels too (about 30 s)
    ("serve_fp8", 80, 50, "client"),
    ("model", 70, 40, "jax"),
    ("correctness", 20, 30, "jax"),
    ("attention", 30, 40, "jax"),
    ("kernels", 35, 20, "jax"),
    ("quant", 30, 75, "jax"),  # the dry run interprets the W4A16 kernel: about 5 s more per compiled step
    ("peers", 20, 5, "torch"),
)
EXIT_MARGIN = (20.0, 3.0)  # seconds before a section's kill time at which it stops starting work (device, dry)
STOP_GRACE_S = 30.0  # after SIGTERM at a section's limit: time to stop its server and save, then SIGKILL
JAX_MEM_FRACTION = "0.9"


def section_env(kind: str, dry: bool, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NETRA_JAX_CACHE"] = str(work / "cache")  # the persistent XLA cache the model and serve sections share
    env["PYTHONUNBUFFERED"] = "1"
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    elif kind in ("jax", "client") and not any(env.get(v) for v in FRACTION_ENV):  # the server is a JAX process
        env[FRACTION_ENV[0]] = JAX_MEM_FRACTION  # jax refuses both variables at once
    return env


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM (the section saves and stops what it started), then SIGKILL after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_server(work: Path) -> None:
    """Stop a server the serve section launched and could not stop itself (it runs in its own session)."""
    pid_file = work / SERVER_PID
    if not pid_file.is_file():
        return
    pid = int(pid_file.read_text())
    pid_file.unlink()
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        t = time.time()
        while time.time() - t < wait:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def run_section(name: str, kind: str, timeout: float, dry: bool, work: Path, merged: dict) -> dict:
    """Run one section in a child process with `timeout` seconds; its saved results plus how it ended."""
    part = work / f"{name}.json"
    prior = work / f"{name}.prior.json"
    prior.write_text(json.dumps(merged))
    part.unlink(missing_ok=True)
    margin = EXIT_MARGIN[1] if dry else EXIT_MARGIN[0]
    deadline = time.time() + max(timeout - margin, timeout * 0.5)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.child", name, str(part), str(prior), str(work)]
    cmd += [f"{deadline:.1f}"]
    cmd += ["--dry-run"] if dry else []
    t0 = time.time()
    print(f"\n===== section {name} ({timeout:.0f}s)", flush=True)
    proc = subprocess.Popen(cmd, env=section_env(kind, dry, work))
    try:
        rc = proc.wait(timeout=timeout)
        status = "ok" if rc == 0 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        stop(proc)
        status = f"stopped at its {timeout:.0f}s budget (results kept up to then)"
    stop_server(work)
    data = json.loads(part.read_text()) if part.is_file() else {}
    if status != "ok" and "error" not in data:
        data["error"] = status
    data["elapsed_s"] = round(time.time() - t0, 1)
    data["budget_s"] = round(timeout)
    data["status"] = status
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results_dir")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the Pallas interpreters")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all sections (default: their sum)")
    ap.add_argument("--sections", default=None, help="comma list of sections to run (default: all)")
    ap.add_argument("--work-dir", default=None, help="scratch directory (default: a new temporary one)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    plan = [s for s in SECTIONS if a.sections is None or s[0] in a.sections.split(",")]
    budgets = {name: (dry_s if dry else dev_s) for name, dev_s, dry_s, _ in plan}
    total = a.budget or sum(budgets.values())
    out_dir = Path(a.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    merged: dict = {
        "check": "gpu_check",
        "dry_run": dry,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "budget_s": total,
        "sections": {},
    }
    stem = None
    for i, (name, _, _, kind) in enumerate(plan):
        left = total - (time.time() - t_start)
        later = sum(budgets[n] for n, *_ in plan[i + 1 :])
        timeout = min(left, budgets[name] + max(0.0, left - budgets[name] - later))  # unused time rolls forward
        device_error = str((merged["sections"].get("device") or {}).get("error"))
        no_gpu = not dry and name != "device" and "no GPU visible" in device_error
        if no_gpu:
            merged["sections"][name] = {"status": "skipped", "error": "no GPU visible to jax"}
        elif timeout < (2 if dry else 10):
            merged["sections"][name] = {"status": "skipped", "error": f"time budget ({left:.0f}s left in all)"}
        else:
            merged["sections"][name] = run_section(name, kind, timeout, dry, work, merged)
        merged["elapsed_s"] = round(time.time() - t_start, 1)
        stem = report.write(merged, out_dir)
    if a.work_dir is None:  # the model directory, the XLA cache and the server log (its tail is in the JSON)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {stem}.json and {stem}.md")
    print(report.summary(merged), flush=True)
    return 0 if all(not s.get("error") for s in merged["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
