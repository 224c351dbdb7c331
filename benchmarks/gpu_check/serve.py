"""Section `serve`: `netra-jax serve` on the model section's directory (random weights, the same engine settings, so
its warm-up reads the model section's compilations from the persistent cache), then `netra-jax bench serve`'s load
generator at each concurrency level in turn (random prompts, ignore_eos): TTFT, TPOT, output tok/s."""

from __future__ import annotations

import asyncio
import functools
import shlex
import time

from benchmarks.gpu_check import engine_settings
from benchmarks.gpu_check.common import SERVER_PID, Section, sig
from benchmarks.gpu_check.model_dir import ensure_model_dir

KEEP = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
)


def one_level(url: str, users: int, prompts: int, sec: Section, warm: bool) -> dict:
    """One closed-loop pass; without a server warm-up, `users` requests go first (left out of the statistics) so
    the step variants of this level compile before it is timed."""
    from netra_jax.bench import serve as bench

    sz = sec.sizes
    flags = {
        "--base-url": url,
        "--max-concurrency": users,
        "--num-prompts": prompts,
        "--dataset": "random",
        "--input-len": sz.prompt_len,
        "--output-len": sz.output_len,
        "--seed": users,
        "--timeout": max(30.0, sec.left()),
        "--warmup": 0 if warm else users,
    }
    argv = [str(x) for kv in flags.items() for x in kv] + ["--ignore-eos", "--disable-tqdm"]
    args = bench.parse_args(argv)
    res = asyncio.run(bench.run(args))
    m = res["runs"][0]
    row = {k: sig(m[k]) if isinstance(m.get(k), float) else m.get(k) for k in KEEP}
    row["text_source"] = res["config"].get("text_source")
    if m.get("errors"):
        row["errors"] = m["errors"]
    return row


def run(sec: Section) -> None:
    from netra_jax.bench.launch import launched

    path = ensure_model_dir(sec.work, sec.dry)
    # warm up only when the model section's warm-up finished: its compilations are then in the persistent cache
    warm = bool(((sec.prior.get("model") or {}).get("ready") or {}).get("warmup", {}).get("complete"))
    sec.set("server_warmup", warm)
    server_args = shlex.join([str(path), *engine_settings.serve_flags(sec.dry, warm)])
    sec.set("server_args", server_args)
    log = sec.work / "serve.log"
    pid_file = sec.work / SERVER_PID  # the runner stops a server this process could not (killed at its limit)
    t = time.perf_counter()
    try:
        with launched(server_args, timeout=max(10.0, sec.left()), log_path=str(log), pid_file=str(pid_file)) as url:
            sec.set("time_to_ready_s", sig(time.perf_counter() - t))
            for users, n in zip(sec.sizes.serve_users, sec.sizes.serve_prompts, strict=True):
                level = functools.partial(one_level, url, users, n, sec, warm)
                sec.attempt("levels", {"users": users, "prompts": n}, level, need_s=3 if sec.dry else 15)
        pid_file.unlink(missing_ok=True)  # stopped: nothing left for the runner to stop
    finally:
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-25:]
            sec.set("server_log_tail", tail)
