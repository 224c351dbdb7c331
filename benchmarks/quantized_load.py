"""Loading a quantized GGUF file: wall time and peak RSS of netra-jax and of llama.cpp's llama-server on the same file,
one engine at a time, with the runtime's own baseline and what netra-jax writes to its parameter cache.

netra-jax: `netra-jax generate PROMPT FILE --max-tokens 16` in a fresh process (load, KV cache, compile the steps it
runs, 16 tokens), timed whole, its peak RSS from the kernel (`ru_maxrss` of the child); the baseline is a process
that imports netra_jax and starts the CPU device (`import netra_jax, jax; jax.numpy.zeros(1)`). And `load_model`
alone in a fresh process: its wall time, the peak RSS over that process's own baseline (the load's footprint,
against the file's size) and the bytes of parameters it holds.
llama.cpp: `llama-server -m FILE -c CTX --threads 2` until /health answers 200 (the model loaded, the KV cache and
compute buffers allocated), its peak RSS (VmHWM) then; it maps the file, so its RSS counts the file's pages it reads.

Usage: .venv/bin/python -m benchmarks.quantized_load FILE.gguf [FILE2.gguf ...] [--llama-server BIN] [--ctx 4096]
       [--out benchmarks/results/<date>-quantized_load.json]"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from netra_jax.bench.launch import free_port
from netra_jax.bench.machine import describe, machine_info
from netra_jax.bench.results import write_result

HERE = Path(__file__).resolve().parent

PROMPT = "The capital of France is"
BASELINE = "import netra_jax, jax; jax.numpy.zeros(1).block_until_ready()"
LOAD_ONLY = """
import json, resource, sys, time
import jax, netra_jax
from netra_jax.loader import load_model
jax.numpy.zeros(1).block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
cfg, params = load_model(sys.argv[1], cache=False)
jax.block_until_ready(params)
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
held = sum({a.unsafe_buffer_pointer(): a.nbytes for a in jax.tree.leaves(params)}.values())
print(json.dumps({"wall_s": round(wall, 2), "baseline_rss_bytes": base, "peak_rss_bytes": peak, "params_bytes": held}))
"""


def _child_run(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` to completion under a fresh wrapper process: its wall time, exit status, output tails and peak RSS
    (the wrapper's RUSAGE_CHILDREN: `cmd` is its only child)."""
    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(json.dumps({'rc': p.returncode, 'wall_s': time.perf_counter() - t,"
        " 'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, 'out': p.stdout[-400:],"
        " 'err': p.stderr[-2000:]}))\n"
    )
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def netra(file: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="netra-load-cache-"))
    env = {**os.environ, "NETRA_JAX_CACHE": str(cache)}
    try:
        cli = [sys.executable, "-m", "netra_jax.cli", "generate", PROMPT, str(file), "--max-tokens", "16"]
        kernels = Path(os.environ.get("NETRA_JAX_CACHE", Path.home() / ".cache" / "netra_jax")) / "kernels"
        if kernels.is_dir():  # the C++ kernels already built: a load, not a compiler run
            shutil.copytree(kernels, cache / "kernels")
        cached = _dir_bytes(cache)
        r = _child_run(cli, env)
        if r["rc"]:
            raise SystemExit(f"netra-jax generate failed:\n{r['err']}")
        load = subprocess.run([sys.executable, "-c", LOAD_ONLY, str(file)], capture_output=True, text=True, env=env)
        if load.returncode:
            raise SystemExit(f"load_model failed:\n{load.stderr[-2000:]}")
        only = json.loads(load.stdout.strip().splitlines()[-1])
        only["peak_over_baseline_per_file"] = round(
            (only["peak_rss_bytes"] - only["baseline_rss_bytes"]) / file.stat().st_size, 3
        )
        return {
            "load_model": only,
            "wall_s": round(r["wall_s"], 2),
            "peak_rss_bytes": r["peak_rss"],
            "written_to_cache_bytes": _dir_bytes(cache / "params"),
            "kernels_cache_bytes": cached,
            "text": r["out"].strip()[-200:],
        }
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def llama(binary: str, file: Path, ctx: int) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    cmd = [binary, "-m", str(file), "-c", str(ctx), "--threads", "2", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        status = Path(f"/proc/{proc.pid}/status").read_text()
        hwm = next(int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmHWM:"))
        return {"ready_s": round(ready, 2), "peak_rss_bytes": hwm, "ctx": ctx}
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    base = _child_run([sys.executable, "-c", BASELINE])
    rows = []
    for f in a.files:
        row = {"file": f.name, "bytes": f.stat().st_size, "netra_jax": netra(f)}
        if a.llama_server:
            row["llama_cpp"] = llama(a.llama_server, f, a.ctx)
        print(json.dumps(row))
        rows.append(row)
    doc = {
        "machine": describe(machine_info()),
        "baseline": {"cmd": BASELINE, "peak_rss_bytes": base["peak_rss"], "wall_s": round(base["wall_s"], 2)},
        "prompt": PROMPT,
        "max_tokens": 16,
        "results": rows,
    }
    write_result(doc, "quantized_load", HERE / "results", a.out)


if __name__ == "__main__":
    main()
