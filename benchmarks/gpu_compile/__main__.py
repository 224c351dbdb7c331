"""The GPU compile check: every attention-kernel configuration and every step program of gpu_check.configs (and the
decode and prefill steps of jobs.LORA_STEPS with LoRA adapter slots) compiled for the H100 and H200 (sm_90a) and A100
(sm_80) targets on a machine without a GPU, in a pool of compiling processes; writes
OUT/<date>-gpu_compile-<target>.json and .md and exits 1 if any kernel spills, goes over its budget or fails to
compile, or any step program's temporaries exceed the memory sizing's margin. Targets of one architecture and one
shared-memory limit (the H100 and the H200) compile to the same kernel binaries: their kernel cases compile once, for
the first of them, and both reports carry them; the step programs compile for each (their memory sizing differs).

Usage: python -m benchmarks.gpu_compile [--targets h100,h200,a100] [--only kernels|steps] [--cases SUBSTRING]
[--models llama3-8b,...] [--workers N] [--depth LAYERS] [--out DIR] [--self-test]  (from the repository root, the
CUDA plugin importable: `make gpu-compile`). Each step row says what one step launches and whether one CUDA graph
captures it (from its thunk sequence). --depth compiles the step programs with their first LAYERS layers (the same
kernels and temporaries as the full model, in a fraction of the time; the memory sizing stays the full model's): CI's
setting.
--self-test compiles the deliberately broken cases of gpu_compile.selftest instead and exits 0 only if the check
fails each of them for its reason."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import multiprocessing
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only plans: the workers compile

from benchmarks.gpu_compile import jobs, report, worker  # noqa: E402
from netra_jax.targets import GPU_TARGETS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def plan_jobs(
    pool: cf.Executor,
    targets: list[str],
    only: str | None,
    cases: str | None,
    depth: int | None,
    models: list[str] | None = None,
):
    """Every job, most expensive first (step programs, then Mosaic kernels), so the pool ends evenly; `models`: the
    step programs of these models of configs.STEP_MODELS only."""
    from benchmarks.gpu_check import configs

    steps, kernels = [], []
    if only != "kernels":
        step_models = models or list(configs.STEP_MODELS)
        counts = {(t, m): pool.submit(worker.plan, t, m) for t in targets for m in step_models}
        for (t, m), n in counts.items():
            steps += [("step", t, m, i, depth) for i in range(n.result())]
            for method in configs.QUANT_STEPS.get(m, ()):  # quantized weights: the smallest and the largest step
                steps += [("step", t, m, i, depth, method) for i in (0, n.result() - 1)]
            if m in jobs.LORA_STEPS:  # with LoRA adapter slots: the smallest and the largest step
                steps += [("step", t, m, i, depth, None, jobs.LORA_STEPS[m]) for i in (0, n.result() - 1)]
    if only != "steps":
        for t in targets:
            if kernel_twin(t, targets) != t:  # the same binaries as an earlier target's
                continue
            for i, case in enumerate(configs.kernel_cases(t)):
                if cases is None or cases in case.name:
                    kernels.append(("kernel", t, i))
    steps.sort(key=lambda j: -j[3])  # the largest buckets compile longest
    kernels.sort(key=lambda j: configs.kernel_cases(j[1])[j[2]].kernel != "mosaic")
    return steps + kernels


def kernel_twin(target: str, targets: list[str]) -> str:
    """The first of `targets` whose kernels compile to the same binaries as `target`'s (same architecture and shared
    memory per block, so the same configuration list and the same ptxas report): `target` itself if none before it."""
    arch = GPU_TARGETS[target].arch, GPU_TARGETS[target].smem_per_block
    return next(t for t in targets if (GPU_TARGETS[t].arch, GPU_TARGETS[t].smem_per_block) == arch)


def _line(row: dict) -> str:
    kind, target = row["job"][:2]
    name = row.get("case") or f"{row.get('model')} {row.get('num_tokens')} tokens"
    what = report.step_line(row) if kind == "step" else report.kernel_line(row)
    verdict = "FAIL " + report._verdict(row) if report.failed(row) else "ok"
    return f"[{target}] {kind} {name}: {what} ({row['seconds']:.1f}s) {verdict}"


def run_pool(jobs: list[tuple], pool: cf.Executor) -> list[dict]:
    futures = {pool.submit(worker.run, job): job for job in jobs}
    rows = []
    for i, fut in enumerate(cf.as_completed(futures), 1):
        try:
            row = fut.result()
        except Exception as e:  # a worker died (a crash in a compiler): the job's result (and the others in flight)
            row = {"job": list(futures[fut]), "seconds": 0.0, "problems": [f"the compiling process died: {e!r}"]}
        rows.append(row)
        print(f"{i}/{len(jobs)} {_line(row)}", flush=True)
    return rows


def self_test(pool: cf.Executor) -> int:
    from benchmarks.gpu_compile import selftest

    jobs = [("broken", target, i) for i, (target, _, _) in enumerate(selftest.broken_cases())]
    ok = True
    for row in run_pool(jobs, pool):
        caught = any(row["expected"] in p for p in row.get("problems", []))
        ok &= caught
        print(f"  {'caught' if caught else 'MISSED'}: {row.get('case')} (expected: {row['expected']})", flush=True)
    print("self-test passed: every broken kernel failed the check" if ok else "self-test FAILED", flush=True)
    return 0 if ok else 1


def _job_order(row: dict) -> tuple:
    """A result row's place in the report: by its job's fields, an absent option (None) before any given one."""
    return tuple((x is not None, x if isinstance(x, int) else str(x)) for x in row["job"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="h100,h200,a100")
    ap.add_argument("--only", choices=("kernels", "steps"), default=None)
    ap.add_argument("--cases", default=None, help="compile only the kernel cases whose name contains this")
    ap.add_argument(
        "--depth", type=int, default=None, help="compile the step programs with this many layers (default: all)"
    )
    ap.add_argument("--models", default=None, help="comma list: the step programs of these models only")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    targets = a.targets.split(",")
    unknown = [t for t in targets if t not in GPU_TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; known: {', '.join(GPU_TARGETS)}")
    ctx = multiprocessing.get_context("spawn")  # fresh processes: the compilers read their environment at start
    t0 = time.time()
    with cf.ProcessPoolExecutor(a.workers, mp_context=ctx, initializer=worker.init) as pool:
        if a.self_test:
            return self_test(pool)
        jobs = plan_jobs(pool, targets, a.only, a.cases, a.depth, a.models.split(",") if a.models else None)
        print(f"{len(jobs)} compile jobs on {a.workers} processes", flush=True)
        rows = run_pool(jobs, pool)
    seconds = time.time() - t0
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import jax

    from netra_jax.bench.machine import describe, machine_info

    failures = 0
    for t in targets:
        twin = kernel_twin(t, targets)
        mine = [r for r in rows if r["job"][1] == t and r["job"][0] == "step"]
        mine += [r for r in rows if r["job"][1] == twin and r["job"][0] == "kernel"]
        result = {
            "check": "gpu_compile",
            "target": t,
            "arch": GPU_TARGETS[t].arch,
            "kernels_compiled_for": twin,  # the target whose compile of the same binaries these kernel rows are
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "host": describe(machine_info()),
            "workers": a.workers,
            "step_layers": a.depth or "all",
            "seconds": round(seconds, 1),
            "kernels": sorted((r for r in mine if r["job"][0] == "kernel"), key=_job_order),
            "steps": sorted((r for r in mine if r["job"][0] == "step"), key=_job_order),
        }
        result["summary"] = report.summary(result)
        stem = report.write(result, out_dir)
        s = result["summary"]
        failures += s["kernel_cases_failed"] + s["step_programs_failed"]
        print(f"{t}: {s} -> {stem}.json, .md", flush=True)
    print(f"{failures} failed; {len(rows)} compiles in {seconds:.0f}s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
