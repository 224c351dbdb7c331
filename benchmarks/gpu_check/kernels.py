"""Section `kernels`: the configuration list the GPU compile check compiles without a GPU (gpu_check.configs: every
attention-kernel and grouped-matmul configuration the selection code returns), compiled and run on this GPU: each
case's compile (lowered here, compiled in a thread pool), its time on random inputs of the compiled shapes, and its
output against the float32 reference on the same inputs. Hopper GPUs run the H200 list, others the A100 one; the
cases the correctness section does not already cover numerically come first (head_dim 256 with P in registers, the
grouped matmul, the packed W4A16 / W8A16 matmul and the fp8 products, float32 Triton), so a spent budget skips the
most covered ones. The dry run takes one small case of
each kernel through the interpreters."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check import configs
from benchmarks.gpu_check.common import Section, median_time, sig
from netra_jax.targets import gpu_target_of

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-3}  # relative error, as the correctness section's (fp8: against the
# same rounding in float32, gpu_check.quant_configs.Fp8Case.reference)


def target_of(device) -> str:
    """The compile check's target whose list this GPU runs: its own when the check describes it, else the list of
    its architecture (Hopper: the H200's, else the A100's)."""
    named = gpu_target_of(device.device_kind)
    if named is not None:
        return named
    cc = str(getattr(device, "compute_capability", "") or "")
    return "h200" if cc.startswith("9") else "a100"


def _priority(case) -> int:
    if getattr(case.config, "p_in_registers", False) or case.kernel in ("grouped_matmul", "packed_matmul"):
        return 0
    if case.kernel == "fp8":  # XLA's own GEMMs: their times, after the Pallas kernels
        return 1
    return 1 if case.dtype == "float32" else 2


def ordered_cases(dry: bool):
    if dry:
        return list(configs.dry_cases())
    cases = configs.kernel_cases(target_of(jax.devices()[0]))
    return sorted(cases, key=_priority)


def _error(got, want) -> dict:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = got - want
    return {
        "max_abs_err": sig(float(np.abs(err).max()), 3),
        "rel_err": sig(float(np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)), 3),
        "finite": bool(np.isfinite(got).all()),
    }


def measure(case, compiled, inputs, dry: bool) -> dict:
    out = compiled(*inputs)
    want = jax.jit(case.reference)(*inputs)
    row = _error(out.astype(jnp.float32), want)
    row["ok"] = bool(row["finite"] and row["rel_err"] is not None and row["rel_err"] < TOLERANCE[case.dtype])
    if not dry:
        row["us"] = sig(median_time(lambda i: compiled(*inputs), jax.block_until_ready, reps=3, inner=5) * 1e6)
    return row


def run(sec: Section) -> None:
    cases = ordered_cases(sec.dry)
    sec.set("target", "dry" if sec.dry else target_of(jax.devices()[0]))
    sec.set("num_cases", len(cases))
    workers = min(8, os.cpu_count() or 1)
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="kernels-compile") as pool:
        pending = []  # (case, inputs, lower seconds, future of the compile), lowered in order ahead of the runs
        it = iter(cases)

        def lower_next() -> bool:
            case = next(it, None)
            if case is None:
                return False
            inputs = case.inputs(seed=len(pending))
            t = time.perf_counter()
            try:
                lowered = jax.jit(case.function(interpret=sec.dry)).lower(*inputs)
            except Exception as e:  # a lowering error is this case's result
                sec.add("cases", {"case": case.name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"})
                return True
            pending.append((case, inputs, time.perf_counter() - t, time.perf_counter(), pool.submit(lowered.compile)))
            return True

        while len(pending) < workers and lower_next():
            pass
        while pending:
            case, inputs, lower_s, t0, fut = pending.pop(0)
            what = {"case": case.name, "kernel": case.kernel, "dtype": case.dtype}
            if sec.left() < (2 if sec.dry else 4):
                sec.skip("cases", what, f"time budget ({sec.left():.0f}s left)")
                fut.cancel()
                continue

            def one(case=case, inputs=inputs, lower_s=lower_s, t0=t0, fut=fut) -> dict:
                compiled = fut.result()
                row = {"lower_s": sig(lower_s, 3), "compile_s": sig(time.perf_counter() - t0, 3)}
                return row | measure(case, compiled, inputs, sec.dry)

            sec.attempt("cases", what, one)
            lower_next()
    rows = sec.data.get("cases", [])
    measured = [r for r in rows if "skipped" not in r]
    sec.set("summary", {"measured": len(measured), "ok": sum(bool(r.get("ok")) for r in measured)})
