"""Time to ready of `netra-jax serve` on the default model: seconds from process start to the first 200 on /health
and on /ready, with a cold persistent compilation cache (a fresh directory) and then warm (a second start on it).

    .venv/bin/python benchmarks/time_to_ready.py                  # one cold + one warm start, quiet
    .venv/bin/python benchmarks/time_to_ready.py --repeat 3 --load   # three pairs, another process burning a core
    .venv/bin/python benchmarks/time_to_ready.py --git-rev 6ed6173 --label before   # an older commit, same harness

Each pair gets its own cache root ($NETRA_JAX_CACHE) holding a fresh xla/ directory and links to the real cache's
default model and converted parameters (loaded once first, so that no timed start converts them): only the
compilation cache is cold. While a server warms up, /health
must answer 200 and /ready 503 (recorded as probe counts). Results go to benchmarks/results/<date>-time_to_ready
[_<label>].json with the machine's description and load averages (starts on a shared machine are noisy: repeat)."""

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
from pathlib import Path

from netra_jax.assets import cache_dir
from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
POLL_S = 0.1


def fresh_cache_root(parent: Path) -> Path:
    """A cache root whose xla/ is empty and whose model and parameter caches are the real ones (linked)."""
    root = Path(tempfile.mkdtemp(prefix="ttr-cache-", dir=parent))
    for name in ("smollm2", "params"):
        src = cache_dir() / name
        if src.exists():
            (root / name).symlink_to(src, target_is_directory=True)
    return root


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


def prime_parameter_cache(env: dict, log_dir: Path) -> None:
    """Load the default model once in a separate process, so that no timed start converts its weights (a start
    after a change of the loader's code would otherwise convert them and be slower for that alone)."""
    code = "from netra_jax.engine.factory import resolve_model_path; from netra_jax.loader import load_model; "
    code += "load_model(resolve_model_path(None))"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=str(log_dir), check=True, capture_output=True)


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


def start_once(cache_root: Path, server_args: list[str], env: dict, timeout: float, log_dir: Path, tag: str) -> dict:
    """One start: seconds to the first /health 200 and /ready 200, the CPU seconds the server had used by then
    (less sensitive than wall time to other work on the machine), the probe answers seen during warm-up, and what
    the server printed about loading and warm-up."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = log_dir / f"{tag}.log"
    cmd = [sys.executable, "-m", "netra_jax.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *server_args]
    env = {**env, "NETRA_JAX_CACHE": str(cache_root), "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1, help="cold + warm pairs (each with its own fresh cache)")
    p.add_argument("--load", action="store_true", help="keep another process burning one core meanwhile")
    p.add_argument("--git-rev", default=None, help="run the server from this commit (git archive) instead")
    p.add_argument("--label", default=None, help="suffix of the result file name")
    p.add_argument("--server-args", default="", help="extra `netra-jax serve` flags, one shell-quoted string")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take")
    p.add_argument("--out", default=None, help="result JSON path (default benchmarks/results/<date>-...json)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="time-to-ready-"))
    env = dict(os.environ)
    if a.git_rev:
        env["PYTHONPATH"] = str(source_tree(a.git_rev, work))
    prime_parameter_cache(env, work)
    burner = None
    if a.load:
        burner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    runs = []
    try:
        for i in range(a.repeat):
            cache = fresh_cache_root(work)
            for kind in ("cold", "warm"):
                r = start_once(cache, shlex.split(a.server_args), env, a.timeout, work, f"{i}-{kind}")
                r.update(trial=i, cache=kind)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    summary = {}
    for kind in ("cold", "warm"):
        ready = [r["ready_s"] for r in runs if r["cache"] == kind]
        cpu = [r["cpu_s_to_ready"] for r in runs if r["cache"] == kind and r["cpu_s_to_ready"] is not None]
        summary[kind] = {
            "ready_s_min": min(ready),
            "ready_s_max": max(ready),
            "cpu_s_to_ready_min": min(cpu, default=None),
            "n": len(ready),
        }
    result = {
        "benchmark": "time_to_ready",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_rev": a.git_rev
        or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "server_args": a.server_args,
        "load": "one extra process burning a core" if a.load else "none added",
        "machine": machine_info(),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary), flush=True)
    write_result(result, f"time_to_ready{'_' + a.label if a.label else ''}", RESULTS, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
