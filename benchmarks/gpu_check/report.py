"""The GPU check's report: the merged JSON and a markdown file of tables (each section's rows, ratios to the peers,
the issue's goals against what was reached, what was skipped and why), rewritten after every section."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.gpu_check import serve_report
from benchmarks.gpu_check.common import fmt, sizes, why
from netra_jax.targets import gpu_target_of


def device_slug(merged: dict) -> str:
    if merged.get("dry_run"):
        return "cpu-dry"
    kind = ((merged["sections"].get("device") or {}).get("env") or {}).get("device_kind", "gpu")
    return gpu_target_of(kind) or re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "gpu"


def write(merged: dict, out_dir: Path) -> Path:
    """<date>-gpu_check-<device>.json and .md, and the serving sweeps' <date>-gpu_serve-<device> files."""
    stem = out_dir / f"{merged['date'][:10]}-gpu_check-{device_slug(merged)}"
    Path(f"{stem}.json").write_text(json.dumps(merged, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(merged))
    serve_report.write(merged, out_dir / f"{merged['date'][:10]}-gpu_serve-{device_slug(merged)}")
    return stem


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out + [""]


def _rows(merged: dict, section: str, key: str) -> list[dict]:
    return (merged["sections"].get(section) or {}).get(key) or []


def _ratio(a, b):
    return round(a / b, 2) if a and b else None


def attention_table(merged: dict, kind: str) -> list[str]:
    rows = _rows(merged, "attention", kind)
    flash = {r["shape"]: r for r in _rows(merged, "peers", "flash_sdpa") if "us" in r}
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "shape" in r))
    out = []
    for shape in shapes:
        by = {r["impl"]: r for r in rows if r.get("shape") == shape and "impl" in r}
        if not by:  # the whole shape was skipped
            out.append([shape, None] + [why(next(r for r in rows if r.get("shape") == shape))] + [None] * 7)
            continue
        cells = [shape, next(iter(by.values())).get("kv_mib")]
        for impl in ("mosaic", "triton", "xla_dense"):
            r = by.get(impl, {})
            cells += [r.get("us"), r.get("frac_copy_bw")] if "us" in r else [why(r), None]
        f = flash.get(shape, {})
        best = min((by[i]["us"] for i in ("mosaic", "triton") if "us" in by.get(i, {})), default=None)
        cells += [f.get("us"), _ratio(f.get("us"), best)]
        out.append(cells)
    header = [
        "shape",
        "KV MiB",
        "Mosaic us",
        "Mosaic / copy BW",
        "Triton us",
        "Triton / copy BW",
        "XLA dense us",
        "XLA / copy BW",
        "torch flash SDPA us",
        "flash / best paged (>1: paged faster)",
    ]
    return _table(header, out) if out else ["(none)", ""]


def _level(merged: dict, section: str, sweep: str, users: int) -> float | None:
    rows = _rows(merged, section, "levels")
    return next((r.get("output_throughput") for r in rows if r.get("sweep") == sweep and r.get("users") == users), None)


def goals(merged: dict) -> list[list]:
    """The serving issue's goals against what this run reached."""
    decode = [
        r.get("frac_copy_bw")
        for r in _rows(merged, "attention", "decode")
        if r.get("frac_copy_bw") and r.get("shape") == "b64_ctx8192" and r.get("impl") != "xla_dense"
    ]
    b1 = next(iter(_rows(merged, "model", "batch1")), {})
    fp8 = next((r for r in _rows(merged, "quant", "batch1") if r.get("method") == "fp8"), {})
    idle = next((r.get("idle_fraction") for r in _rows(merged, "model", "profile") if r.get("users", 0) >= 256), None)
    return [
        ["8B batch-1 bf16 decode MBU (of the weight-read roofline)", ">= 0.75", b1.get("mbu")],
        ["8B batch-1 bf16 decode tok/s", "H100 >= 168, H200 >= 240", b1.get("decode_tok_s")],
        ["fp8 / bf16 batch-1 decode", ">= 1.6", _ratio(fp8.get("decode_tok_s"), b1.get("decode_tok_s"))],
        ["device idle between decode steps at 256 users", "<= 0.05", idle],
        ["output tok/s, 128 users, short (1024/256), bf16", ">= 10000", _level(merged, "serve", "short", 128)],
        [
            "output tok/s, 128 users, short, fp8 (NIM: 12,215 at 100 users)",
            "> 12215",
            _level(merged, "serve_fp8", "short", 128),
        ],
        ["decode attention, 64 users at 8192 tokens, of copy bandwidth", ">= 0.8", max(decode, default=None)],
    ]


def markdown(merged: dict) -> str:
    s = merged["sections"]
    dev = s.get("device") or {}
    env = dev.get("env") or {}
    lines = [
        f"# GPU check, {merged['date']}" + (" (DRY RUN: CPU, tiny shapes, interpreters)" if merged["dry_run"] else ""),
        "",
    ]
    lines += [
        f"Device: {env.get('device_kind', '?')} ({env.get('backend', '?')}), jax {env.get('jax', '?')}; "
        f"copy bandwidth {fmt(dev.get('copy_gbps'))} GB/s (read + write), bf16 matmul "
        f"{fmt(dev.get('matmul_tflops'))} TFLOP/s; {merged.get('elapsed_s', '?')} s of a "
        f"{merged['budget_s']:.0f} s budget.",
        "",
    ]
    lines += ["## Sections", ""] + _table(
        ["section", "status", "seconds", "budget", "error"],
        [
            [
                n,
                d.get("status"),
                d.get("elapsed_s"),
                d.get("budget_s"),
                (d.get("error") or "").strip()[-160:].replace("\n", " ").replace("|", "/"),
            ]
            for n, d in s.items()
        ],
    )
    lines += ["## Goals", ""] + _table(["goal", "target", "reached"], goals(merged))
    corr = [
        [r["backend"], r["dtype"], r["case"], r.get("max_abs_err"), r.get("rel_err"), r.get("ok"), why(r)]
        for r in _rows(merged, "correctness", "results")
    ]
    lines += ["## 1. Correctness against the jnp reference (f32 on the device)", ""]
    lines += _table(["backend", "dtype", "case", "max abs err", "rel err", "ok", "note"], corr)
    lines += kernels_lines(merged)
    sz = sizes(merged["dry_run"])
    shape = f"{sz.heads} q / {sz.kv_heads} kv heads, head_dim {sz.head_dim}, pages of {sz.page_size}"
    lines += [f"## 2. Paged attention (bf16, {shape})", "", "Decode:", ""]
    lines += attention_table(merged, "decode") + ["Mixed steps:", ""] + attention_table(merged, "mixed")
    kvw = [
        [r.get("impl"), r.get("tokens"), r.get("us"), r.get("written_ok"), why(r)]
        for r in _rows(merged, "attention", "kv_write")
    ]
    lines += ["KV write (cache donated):", ""] + _table(["impl", "tokens", "us", "written ok", "note"], kvw)
    lines += model_lines(merged) + quant_lines(merged) + serve_lines(merged) + skipped_lines(merged)
    return "\n".join(lines) + "\n"


def kernels_lines(merged: dict) -> list[str]:
    k = merged["sections"].get("kernels") or {}
    rows = [
        [r.get("case"), r.get("compile_s"), r.get("us"), r.get("rel_err"), r.get("ok"), why(r)]
        for r in _rows(merged, "kernels", "cases")
    ]
    summary = k.get("summary") or {}
    head = (
        f"The compile check's configuration list for {k.get('target', '-')} (gpu_check/configs.py), compiled and run "
        f"here: {summary.get('ok', 0)} of {summary.get('measured', 0)} measured cases within tolerance, "
        f"{k.get('num_cases', 0)} in the list."
    )
    return ["## 1b. Kernel configurations (the compile check's list)", "", head, ""] + _table(
        ["case", "compile s", "us", "rel err", "ok", "note"], rows
    )


def ready_text(ready: dict) -> str:
    warm = ready.get("warmup") or {}
    build = f"build {fmt(ready.get('build_s'))} s"
    if warm.get("complete"):
        return f"{fmt(ready.get('time_to_ready_s'))} s ({build})"
    return (
        f"not reached: the warm-up compiled {warm.get('compiled', '-')} of {warm.get('step_variants', '-')} step "
        f"variants in {fmt(warm.get('seconds'))} s before its cap (full warm-up estimated at "
        f"{fmt(warm.get('estimated_full_s'))} s; {build})"
    )


def model_lines(merged: dict) -> list[str]:
    m = merged["sections"].get("model") or {}
    hf = {r.get("batch"): r for r in _rows(merged, "peers", "hf_generate")}
    ready = m.get("ready") or {}
    comp = m.get("compiles_after_warmup") or {}
    what = "dry run: a tiny Llama in float32" if merged["dry_run"] else "random bf16 weights"
    lines = [f"## 3. Llama-3.1-8B-shaped model ({what}), `LLM.generate`", ""]
    lines += [
        f"Time to ready (build + warm-up): {ready_text(ready)}. Attention backend "
        f"{ready.get('attention_backend')}; compilations after warm-up: {comp.get('total', '-')} "
        f"({comp.get('model_steps', '-')} of the model step or sampler). Engine: `{m.get('engine')}`.",
        "",
    ]
    b1 = next(iter(_rows(merged, "model", "batch1")), {})
    h1 = hf.get(1, {})
    lines += _table(
        ["batch 1", "decode tok/s", "MBU", "roofline tok/s", "HF generate tok/s", "ours / HF"],
        [
            [
                "",
                b1.get("decode_tok_s"),
                b1.get("mbu"),
                b1.get("roofline_tok_s"),
                h1.get("decode_tok_s"),
                _ratio(b1.get("decode_tok_s"), h1.get("decode_tok_s")),
            ]
        ],
    )
    rows = []
    for r in _rows(merged, "model", "profile"):
        shares = {c: (v or {}).get("share") for c, v in (r.get("classes") or {}).items()}
        rows.append(
            [
                r.get("users"),
                r.get("output_tok_s") or why(r),
                r.get("kernels_per_step"),
                r.get("device_us_per_step"),
                r.get("idle_fraction"),
                r.get("host_us_per_step"),
                ", ".join(f"{c} {fmt(v)}" for c, v in shares.items() if v) or None,
            ]
        )
    header = [
        "users",
        "output tok/s (traced)",
        "kernels / step",
        "device us / step",
        "device idle",
        "host us / step",
        "device time share by class",
    ]
    return lines + ["Steady decode under `jax.profiler` (gpu_check/profile.py):", ""] + _table(header, rows)


def quant_lines(merged: dict) -> list[str]:
    q = merged["sections"].get("quant") or {}
    ready = {r.get("method"): r for r in q.get("ready") or []}
    b1 = {r.get("method"): r for r in _rows(merged, "quant", "batch1")}
    tp = {r.get("method"): r for r in _rows(merged, "quant", "throughput")}
    lines = ["## 3b. The same model quantized at load (GPU matmul backend: W4A16 Pallas kernel, fp8 W8A8)", ""]
    rows = []
    for m in dict.fromkeys([*ready, *b1, *tp]):
        r, b, t = ready.get(m, {}), b1.get(m, {}), tp.get(m, {})
        rows.append(
            [
                m,
                f"{r.get('weights', '-')} on {r.get('matmul_backend', '-')}",
                r.get("weights_gb"),
                ready_text({"build_s": r.get("build_s"), "warmup": r.get("warmup") or {}}) if r else "-",
                b.get("decode_tok_s") or why(b),
                b.get("mbu"),
                f"{t.get('output_tok_s')} ({t.get('batch')} seqs)" if t.get("output_tok_s") else why(t),
            ]
        )
    header = [
        "method",
        "weights, backend",
        "weights GB",
        "ready",
        "batch-1 decode tok/s",
        "MBU (quantized bytes)",
        "output tok/s",
    ]
    return lines + _table(header, rows)


def serve_lines(merged: dict) -> list[str]:
    head = serve_report.headline(merged)
    lines = ["## 4. Serving: `netra-jax serve` + `netra-jax bench serve` (also in the gpu_serve files)", ""]
    if head is None:
        return lines + ["(not run)", ""]
    return lines + serve_report.tables(head) + serve_report.anchor_lines()


def skipped_lines(merged: dict) -> list[str]:
    out = []
    for name, d in merged["sections"].items():
        for key, rows in d.items():
            if isinstance(rows, list):
                for r in rows:
                    if isinstance(r, dict) and ("skipped" in r or "error" in r):
                        what = {k: v for k, v in r.items() if k not in ("skipped", "error")}
                        out.append(f"- {name}/{key} {what}: {r.get('skipped') or 'ERROR ' + r['error']}")
    return (["## Skipped or failed", ""] + out + [""]) if out else []


def summary(merged: dict) -> str:
    """A few lines for the end of the console output."""
    lines = [f"{n}: {d.get('status')} ({d.get('elapsed_s')} s)" for n, d in merged["sections"].items()]
    lines += [f"{g[0]}: {fmt(g[2])} (goal {g[1]})" for g in goals(merged)]
    return "\n".join(lines)
