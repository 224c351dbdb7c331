"""A `jax.profiler` trace around a callable (`capture`) and its summary as a small JSON-able dict (`summarize`):
device time per kernel class, kernels per step, device idle time between steps and host time per step. The trace
files stay where they are written; only the summary is meant to be kept."""

from __future__ import annotations

import bisect
import gzip
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Kernel classes, tried in order; the first that matches names the class. Patterns are searched (case-insensitive)
# in the kernel's name. The `sampler` row is decided by the kernel's XLA module where the trace gives it (any
# program other than the step program, once the step program is in the trace); its pattern serves only kernels
# whose module is unknown.
CLASS_RULES: tuple[tuple[str, str], ...] = (
    # CUPTI's copy and fill activities ("MemcpyH2D", "MemcpyD2H", "MemcpyD2D", "Memset"), whatever program issued them
    ("copy", r"memcpy|memset"),
    # programs other than the step program (jit_sample_tokens, jit_token_logprobs, jit__widen_ids, ...)
    ("sampler", r"sampl|logprob|top_?k|argmax|gumbel|categorical|widen_ids"),
    # Pallas / Triton / Mosaic attention kernels (ragged_paged_attention_*, paged_attention_*) and library attention
    ("attention", r"attention|paged_att|flash|fmha|sdpa"),
    # cuBLAS(Lt) / CUTLASS kernels (nvjet_*, sm90_xmma_gemm_*, cutlass*, gemv*, splitKreduce), XLA's Triton GEMM
    # fusions (gemm_fusion_dot*), Pallas matmuls (packed_matmul_*, grouped_matmul_*) and plain dots
    ("gemm", r"gemm|gemv|cublas|cutlass|xmma|nvjet|wgmma|matmul|splitk|(?<![a-z])dot(?![a-z])"),
    # any other Mosaic GPU kernel: in this engine the paged attention kernel (matmuls matched above)
    ("attention", r"mosaic"),
    # XLA's own fused kernels (loop_*_fusion, input_*_fusion, wrapped_*) and single ops: norms, rotary, residual
    # adds, casts, reductions, KV-cache scatters, gathers, selects
    (
        "norm_elementwise",
        r"fusion|loop_|input_|wrapped_|convert|reduce|scatter|gather|select|transpose|concatenate|broadcast|slice|iota"
        r"|copy|rsqrt|norm|rope|rotary|softmax|elementwise",
    ),
)
CLASSES = ("gemm", "attention", "norm_elementwise", "sampler", "copy", "other")  # `other`: nothing above matched

_RULES = tuple((cls, re.compile(pat, re.IGNORECASE)) for cls, pat in CLASS_RULES)
# lines xprof derives from the kernels' annotations (not kernels themselves) and CUPTI's own bookkeeping line
_DERIVED_LINES = {
    "Steps",
    "XLA Modules",
    "XLA Ops",
    "Async XLA Ops",
    "Framework Ops",
    "Framework Name Scope",
    "Source code",
    "Launch Stats",
    "CUPTI overhead",
}
_MODULE_ID = re.compile(r"^(.*?)\(\d+\)$")  # "jit__step(12)" on the XLA Modules line: module name (program id)
_GPU_MODULE_EVENT = re.compile(r"^(.+):XLA GPU module$")  # host TraceMe around one GPU program execution
_PJIT = re.compile(r"^PjitFunction\((.*)\)$")  # host: one call of a jitted Python function
_DRIVER_API = re.compile(r"^cu[A-Z]")  # host: CUDA driver calls (cuLaunchKernel, ...), which carry hlo_op too
_EPS = 1e-6  # us: the trace's timestamps are rounded to the picosecond


@dataclass
class _Event:
    name: str
    ts: float  # us
    dur: float  # us
    tid: Any
    args: dict

    @property
    def end(self) -> float:
        return self.ts + self.dur


def capture(fn: Callable[[], Any], log_dir: str | Path) -> Path:
    """Run `fn()` inside a `jax.profiler` trace written under `log_dir`, waiting for any arrays it returns, and
    return the trace's gzipped Chrome JSON (`perfetto_trace.json.gz`, else `<host>.trace.json.gz`)."""
    import jax

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    return _find_trace(log_dir, since=start)


def _find_trace(log_dir: Path, since: float = 0.0) -> Path:
    """The newest trace JSON written under log_dir/plugins/profile/<run>/ at or after `since` (a time.time())."""
    found = [
        p
        for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz")
        for p in (log_dir / "plugins" / "profile").glob(f"*/{pattern}")
        if p.stat().st_mtime >= since - 1.0
    ]
    if not found:
        raise FileNotFoundError(f"the profiler wrote no trace JSON (*.trace.json.gz) under {log_dir}/plugins/profile")
    newest_run = max(p.parent.stat().st_mtime for p in found)
    latest = [p for p in found if p.parent.stat().st_mtime == newest_run]
    return next((p for p in latest if p.name == "perfetto_trace.json.gz"), latest[0])


def _load(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return events if isinstance(events, list) else []


def _event(e: dict) -> _Event | None:
    """A complete ("X") event, or None for any other shape."""
    if e.get("ph") != "X" or not isinstance(e.get("name"), str):
        return None
    try:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    args = e.get("args")
    return _Event(e["name"], ts, max(dur, 0.0), e.get("tid"), args if isinstance(args, dict) else {})


def _leaves(events: list[_Event]) -> list[_Event]:
    """Drop every event that contains another one of its own track (the CPU backend's while / call ops around
    their bodies, a CUDA graph around its kernels): the leaves are what ran."""
    by_track: dict[Any, list[_Event]] = defaultdict(list)
    for ev in events:
        by_track[ev.tid].append(ev)
    out = []
    for track in by_track.values():
        track.sort(key=lambda ev: (ev.ts, -ev.dur))
        parent = [False] * len(track)
        open_: list[int] = []
        for i, ev in enumerate(track):
            while open_ and track[open_[-1]].end <= ev.ts + _EPS:
                open_.pop()
            if open_ and ev.end <= track[open_[-1]].end + _EPS:
                parent[open_[-1]] = True
            open_.append(i)
        out.extend(ev for ev, p in zip(track, parent, strict=True) if not p)
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _module_name(name: str) -> str:
    m = _MODULE_ID.match(name)
    return m.group(1) if m else name


def _outermost(events: list[_Event]) -> list[_Event]:
    """Per thread, the events not inside another of the list (a jitted call's nested PjitFunction events)."""
    out = []
    for tid in {ev.tid for ev in events}:
        end = float("-inf")
        for ev in sorted((ev for ev in events if ev.tid == tid), key=lambda ev: (ev.ts, -ev.dur)):
            if ev.ts >= end - _EPS:
                out.append(ev)
                end = ev.end
    return sorted(out, key=lambda ev: ev.ts)


def classify(name: str, module: str | None, step_module_prefix: str, step_seen: bool) -> str:
    """The kernel class of a kernel named `name` run by XLA module `module` (None: unknown), by CLASS_RULES."""
    for cls, rule in _RULES:
        if cls == "sampler" and module is not None and step_seen:
            if not module.startswith(step_module_prefix):
                return cls
        elif rule.search(name):
            return cls
    return "other"


def summarize(trace_path: str | Path, *, steps: int | None = None, step_module_prefix: str = "jit__step") -> dict:
    """Summarize a trace written by `capture` (any Chrome-JSON trace of jax's profiler, gzipped or not).

    steps: the number of step-program executions in the trace; None: counted from the trace (`steps_source` says
    how). step_module_prefix: how the step program's XLA module is named; kernels of other modules are `sampler`.
    Returns (times in us): `source` ("gpu", or "cpu" where the trace has no device tracks and the host's XLA op
    events stand in for kernels), `device` (the tracks read), `step_modules`, `classes` ({class: us, share of the
    summed kernel time, kernels}), `kernels`, `kernels_per_step`, `busy_us` (union of the kernels' intervals),
    `window_us` (first kernel start to last kernel end), `idle_us` and `idle_fraction` (window less busy),
    `steps`, `steps_source`, `steps_found`, `device_us_per_step`, `idle_us_per_step`, `wall_us_per_step` (their
    sum), `host_us_per_step` (start-to-start of the host's launches of the step program), `host_launch_us` (the
    mean launch call), `host_launches`, `host_launch_source`, `modules` ({module: kernels, us}) and `top_kernels`
    (the 10 names with most time: class, count, us)."""
    raw = _load(Path(trace_path))
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    by_pid: dict[Any, list[_Event]] = defaultdict(list)
    for e in raw:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M":
            name = (e.get("args") or {}).get("name") if isinstance(e.get("args"), dict) else None
            if e.get("name") == "process_name" and isinstance(name, str):
                procs[e.get("pid")] = name
            elif e.get("name") == "thread_name" and isinstance(name, str):
                threads[(e.get("pid"), e.get("tid"))] = name
            continue
        ev = _event(e)
        if ev is not None:
            by_pid[e.get("pid")].append(ev)

    host_pid = next((pid for pid, n in procs.items() if n.startswith("/host:")), None)
    kernels, modules_line, device = _device_kernels(procs, threads, by_pid)
    if kernels:
        kind = re.match(r"/device:([A-Za-z]+)", device["name"])
        source = kind.group(1).lower() if kind else "device"
    else:  # CPU backend: XLA runs each op as a host event (args: hlo_module, hlo_op, run_id)
        source = "cpu"
        host = by_pid.get(host_pid, [])
        kernels = _leaves(
            [
                ev
                for ev in host
                if "hlo_op" in ev.args and not ev.name.startswith("end: ") and not _DRIVER_API.match(ev.name)
            ]
        )
        tids = sorted({ev.tid for ev in kernels}, key=str)
        device = {
            "name": procs.get(host_pid, "host"),
            "pid": host_pid,
            "tracks": [threads.get((host_pid, t), str(t)) for t in tids],
            "note": "no device tracks: the host's XLA op events (CPU backend)",
        }

    # the XLA module of each kernel: its own args, else the XLA Modules line interval around it
    mod_starts = [ev.ts for ev in modules_line]

    def module_of(ev: _Event) -> str | None:
        if isinstance(ev.args.get("hlo_module"), str):
            return _module_name(ev.args["hlo_module"])
        i = bisect.bisect_right(mod_starts, ev.ts + _EPS) - 1
        if i >= 0 and ev.ts <= modules_line[i].end + _EPS:
            return _module_name(modules_line[i].name)
        return None

    kernels.sort(key=lambda ev: ev.ts)
    mods = [module_of(ev) for ev in kernels]
    step_modules = sorted({m for m in mods if m is not None and m.startswith(step_module_prefix)})
    step_seen = bool(step_modules)
    cls_of = [classify(ev.name, m, step_module_prefix, step_seen) for ev, m in zip(kernels, mods, strict=True)]

    class_us = dict.fromkeys(CLASSES, 0.0)
    class_n = dict.fromkeys(CLASSES, 0)
    per_name: dict[str, list] = {}
    per_module: dict[str, list] = {}
    for ev, m, c in zip(kernels, mods, cls_of, strict=True):
        class_us[c] += ev.dur
        class_n[c] += 1
        rec = per_name.setdefault(ev.name, [c, 0, 0.0])
        rec[1] += 1
        rec[2] += ev.dur
        mrec = per_module.setdefault(m or "?", [0, 0.0])
        mrec[0] += 1
        mrec[1] += ev.dur
    total = sum(class_us.values())
    busy = _union((ev.ts, ev.end) for ev in kernels)
    window = (max(ev.end for ev in kernels) - kernels[0].ts) if kernels else 0.0
    idle = max(window - busy, 0.0)

    # executions of the step program on the device, and the host's launches of it
    launches, launch_kind = _host_launches(by_pid.get(host_pid, []), step_module_prefix)
    found, found_from = _count_steps(kernels, mods, modules_line, step_module_prefix, launches, launch_kind)
    n_steps, steps_source = (steps, "given") if steps is not None else (found, found_from)

    out: dict[str, Any] = {
        "source": source,
        "device": device,
        "step_modules": step_modules,
        "classes": {
            c: {"us": class_us[c], "share": (class_us[c] / total) if total else 0.0, "kernels": class_n[c]}
            for c in CLASSES
        },
        "kernels": len(kernels),
        "kernels_per_step": None,
        "busy_us": busy,
        "window_us": window,
        "idle_us": idle,
        "idle_fraction": (idle / window) if window else 0.0,
        "steps": n_steps,
        "steps_source": steps_source,
        "steps_found": found,
        "device_us_per_step": None,
        "idle_us_per_step": None,
        "wall_us_per_step": None,
        "host_us_per_step": None,
        "host_launch_us": None,
        "host_launches": len(launches),
        "host_launch_source": launch_kind,
        "modules": {m: {"kernels": n, "us": t} for m, (n, t) in sorted(per_module.items(), key=lambda kv: -kv[1][1])},
        "top_kernels": [
            {"name": name, "class": c, "count": n, "us": t}
            for name, (c, n, t) in sorted(per_name.items(), key=lambda kv: (-kv[1][2], kv[0]))[:10]
        ],
    }
    if n_steps:
        out["kernels_per_step"] = len(kernels) / n_steps
        out["device_us_per_step"] = busy / n_steps
        out["idle_us_per_step"] = idle / n_steps
        out["wall_us_per_step"] = window / n_steps
    if len(launches) >= 2:  # start-to-start: the host's time per step in a steady loop
        out["host_us_per_step"] = (launches[-1].ts - launches[0].ts) / (len(launches) - 1)
    if launches:
        out["host_launch_us"] = sum(ev.dur for ev in launches) / len(launches)
    return _rounded(out)


def _device_kernels(procs: dict, threads: dict, by_pid: dict) -> tuple[list[_Event], list[_Event], dict[str, Any]]:
    """The kernels of the first accelerator with any (its "Stream #N(...)" lines; else, on a device without
    them, its XLA Ops line, else every line that is not a derived one), its XLA Modules line, and what was read."""
    devices = sorted(
        (pid for pid, name in procs.items() if name.startswith("/device:") and by_pid.get(pid)),
        key=lambda pid: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", procs[pid])],  # GPU:2 before GPU:10
    )
    for pid in devices:
        names = {tid: threads.get((pid, tid), "") for tid in {ev.tid for ev in by_pid[pid]}}
        streams = {tid for tid, n in names.items() if n.startswith("Stream #")}
        if not streams:
            streams = {tid for tid, n in names.items() if n == "XLA Ops"}
        if not streams:
            streams = {tid for tid, n in names.items() if n not in _DERIVED_LINES}
        kernels = _leaves([ev for ev in by_pid[pid] if ev.tid in streams])
        if not kernels:
            continue
        modules_line = sorted(
            (ev for ev in by_pid[pid] if names.get(ev.tid) == "XLA Modules" and ev.tid not in streams),
            key=lambda ev: ev.ts,
        )
        info = {
            "name": procs[pid],
            "pid": pid,
            "tracks": sorted(names[t] or str(t) for t in streams),
            "modules_line": bool(modules_line),
        }
        others = [procs[p] for p in devices if p != pid]
        if others:
            info["not_read"] = others
        return kernels, modules_line, info
    return [], [], {}


def _host_launches(host: list[_Event], prefix: str) -> tuple[list[_Event], str | None]:
    """The host's launches of the step program: the jitted function's PjitFunction(<name>) calls (module
    jit_<name>), else the GPU runtime's "<module>:XLA GPU module" events."""
    fn_prefix = prefix[len("jit_") :] if prefix.startswith("jit_") else None
    if fn_prefix:
        pjit = [ev for ev in host if (m := _PJIT.match(ev.name)) and m.group(1).startswith(fn_prefix)]
        if pjit:
            return _outermost(pjit), "PjitFunction"
    gpu = [ev for ev in host if (m := _GPU_MODULE_EVENT.match(ev.name)) and m.group(1).startswith(prefix)]
    if gpu:
        return _outermost(gpu), "XLA GPU module"
    return [], None


def _count_steps(
    kernels: list[_Event],
    mods: list[str | None],
    modules_line: list[_Event],
    prefix: str,
    launches: list[_Event],
    launch_kind: str | None,
) -> tuple[int | None, str | None]:
    """Executions of the step program: its events on the device's XLA Modules line, else its distinct run ids
    (CPU backend), else the host's launches of it, else the runs of its kernels between other programs' kernels."""
    on_line = [ev for ev in modules_line if _module_name(ev.name).startswith(prefix)]
    if on_line:
        return len(on_line), "xla_modules_line"
    run_ids = {
        ev.args["run_id"]
        for ev, m in zip(kernels, mods, strict=True)
        if m and m.startswith(prefix) and "run_id" in ev.args
    }
    if run_ids:
        return len(run_ids), "run_id"
    if launches:
        return len(launches), f"host_launches ({launch_kind})"
    runs, inside = 0, False
    for m in mods:
        is_step = m is not None and m.startswith(prefix)
        runs += is_step and not inside
        inside = is_step
    return (runs, "kernel_runs") if runs else (None, None)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x
