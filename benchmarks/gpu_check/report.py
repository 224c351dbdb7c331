"""The GPU check's report: the merged JSON and a markdown file of tables (each section's rows, ratios to the peers,
the issue's goals against what was reached, what was skipped and why), rewritten after every section."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.gpu_check.common import sizes

GOALS = {"decode_frac_copy_bw": 0.70, "batch1_mbu": 0.70, "output_tok_s_100_users": 12000}


def device_slug(merged: dict) -> str:
    if merged.get("dry_run"):
        return "cpu-dry"
    kind = ((merged["sections"].get("device") or {}).get("env") or {}).get("device_kind", "gpu")
    return "h200" if "H200" in kind else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "gpu"


def write(merged: dict, out_dir: Path) -> Path:
    stem = out_dir / f"{merged['date'][:10]}-gpu_check-{device_slug(merged)}"
    Path(f"{stem}.json").write_text(json.dumps(merged, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(merged))
    return stem


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
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
            out.append([shape, None] + [_why(next(r for r in rows if r.get("shape") == shape))] + [None] * 7)
            continue
        cells = [shape, next(iter(by.values())).get("kv_mib")]
        for impl in ("mosaic", "triton", "xla_dense"):
            r = by.get(impl, {})
            cells += [r.get("us"), r.get("frac_copy_bw")] if "us" in r else [_why(r), None]
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


def _why(r: dict) -> str:
    if "skipped" in r:
        return "skipped: " + r["skipped"][:60]
    if "error" in r:
        return "error: " + r["error"][:60]
    return "-"


def goals(merged: dict) -> list[list]:
    decode = [r.get("frac_copy_bw") for r in _rows(merged, "attention", "decode") if r.get("frac_copy_bw")]
    b1 = next(iter(_rows(merged, "model", "batch1")), {})
    levels = {r["users"]: r for r in _rows(merged, "serve", "levels") if r.get("output_throughput")}
    near = {u: levels[u]["output_throughput"] for u in levels if u in (64, 100, 256)}  # 100 if it ran, neighbours
    return [
        ["paged decode attention, best fraction of copy bandwidth", ">= 0.70", max(decode, default=None)],
        ["8B batch-1 decode MBU", ">= 0.70", b1.get("mbu")],
        ["8B batch-1 decode tok/s", "about 210", b1.get("decode_tok_s")],
        [
            "output tok/s at 100 users (64 and 256 beside it)",
            ">= 12000",
            ", ".join(f"{u}: {v}" for u, v in near.items()) or None,
        ],
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
        f"copy bandwidth {_fmt(dev.get('copy_gbps'))} GB/s (read + write), bf16 matmul "
        f"{_fmt(dev.get('matmul_tflops'))} TFLOP/s; {merged.get('elapsed_s', '?')} s of a "
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
        [r["backend"], r["dtype"], r["case"], r.get("max_abs_err"), r.get("rel_err"), r.get("ok"), _why(r)]
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
        [r.get("impl"), r.get("tokens"), r.get("us"), r.get("written_ok"), _why(r)]
        for r in _rows(merged, "attention", "kv_write")
    ]
    lines += ["KV write (cache donated):", ""] + _table(["impl", "tokens", "us", "written ok", "note"], kvw)
    lines += model_lines(merged) + quant_lines(merged) + serve_lines(merged) + skipped_lines(merged)
    return "\n".join(lines) + "\n"


def kernels_lines(merged: dict) -> list[str]:
    k = merged["sections"].get("kernels") or {}
    rows = [
        [r.get("case"), r.get("compile_s"), r.get("us"), r.get("rel_err"), r.get("ok"), _why(r)]
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
    build = f"build {_fmt(ready.get('build_s'))} s"
    if warm.get("complete"):
        return f"{_fmt(ready.get('time_to_ready_s'))} s ({build})"
    return (
        f"not reached: the warm-up compiled {warm.get('compiled', '-')} of {warm.get('step_variants', '-')} step "
        f"variants in {_fmt(warm.get('seconds'))} s before its cap (full warm-up estimated at "
        f"{_fmt(warm.get('estimated_full_s'))} s; {build})"
    )


def model_lines(merged: dict) -> list[str]:
    m = merged["sections"].get("model") or {}
    hf = {r.get("batch"): r for r in _rows(merged, "peers", "hf_generate")}
    ready = m.get("ready") or {}
    comp = m.get("compiles_after_warmup") or {}
    what = "dry run: a tiny Llama in float32" if merged["dry_run"] else "random bf16 weights"
    lines = [f"## 3. Llama-3-8B-shaped model ({what}), `LLM.generate`", ""]
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
    for r in _rows(merged, "model", "throughput"):
        h = hf.get(r.get("batch"), {})
        rows.append(
            [
                r.get("batch"),
                r.get("output_tok_s") or _why(r),
                h.get("output_tok_s"),
                _ratio(r.get("output_tok_s"), h.get("output_tok_s")),
            ]
        )
    return lines + _table(["batch", "output tok/s", "HF generate tok/s", "ours / HF"], rows)


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
                b.get("decode_tok_s") or _why(b),
                b.get("mbu"),
                f"{t.get('output_tok_s')} ({t.get('batch')} seqs)" if t.get("output_tok_s") else _why(t),
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
    sv = merged["sections"].get("serve") or {}
    lines = ["## 4. Serving: `netra-jax serve` + `netra-jax bench serve`", ""]
    lines += [f"Server ready after {_fmt(sv.get('time_to_ready_s'))} s; `netra-jax serve {sv.get('server_args')}`", ""]
    rows = [
        [
            r.get("users"),
            r.get("prompts"),
            r.get("failed"),
            r.get("output_throughput") or _why(r),
            r.get("median_ttft_ms"),
            r.get("median_tpot_ms"),
            r.get("p99_tpot_ms"),
        ]
        for r in sv.get("levels") or []
    ]
    header = ["users", "requests", "failed", "output tok/s", "median TTFT ms", "median TPOT ms", "p99 TPOT ms"]
    return lines + _table(header, rows)


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
    lines += [f"{g[0]}: {_fmt(g[2])} (goal {g[1]})" for g in goals(merged)]
    return "\n".join(lines)
