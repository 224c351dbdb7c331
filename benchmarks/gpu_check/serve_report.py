"""The headline result of the GPU check: the serving sweeps of sections `serve` (bf16) and `serve_fp8` as
<date>-gpu_serve-<device>.json, .md and .png, with the engine's sizing on the device and the published anchors for a
Llama-3.1-8B on one GPU beside them (each with its source)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_check.common import fmt, why

SERVE_SECTIONS = (("serve", "bf16"), ("serve_fp8", "fp8"))

# Published figures for Llama-3.1-8B on one GPU, each with its source; "users" where the source gives concurrency.
ANCHORS = (
    {
        "source": "NVIDIA NIM for LLMs 1.8, benchmarking guide, performance (Llama-3.1-8B-Instruct, one H100)",
        "setting": "output tok/s at 1 / 50 / 100 / 200 / 250 users",
        "users": [1, 50, 100, 200, 250],
        "output_tok_s": [214.6, 8018, 12215, 13348, 12965],
        "note": "ITL 4.63 ms and TTFT 10 ms at 1 user",
    },
    {
        "source": "TensorRT-LLM performance overview, FP8, offline throughput",
        "setting": "1000/1000 and 20000/2000 tokens (input/output)",
        "h200_output_tok_s": [17744, 1804],
        "h100_output_tok_s": [15220, 1351],
    },
    {
        "source": "vLLM V1 release post (2025)",
        "setting": "8B on H100",
        "note": "about 5 ms of GPU time per step, so host overhead bounds throughput: async scheduling, a "
        "persistent batch, CUDA graphs",
    },
    {
        "source": "weight-read roofline (16.06 GB of bf16 weights, 8.03 GB in fp8, per decode step)",
        "setting": "batch-1 decode tok/s bounds",
        "h100": {"bf16": 223, "fp8": 417},
        "h200": {"bf16": 320, "fp8": 598},
    },
)

COLUMNS = (
    ("users", "users"),
    ("prompts", "requests"),
    ("completed", "completed"),
    ("cut", "cut at the pass's limit"),
    ("failed", "failed"),
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT median ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT median ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)


def headline(merged: dict) -> dict | None:
    """The sweeps' rows per variant with the sizing and time to ready; None when no serving section ran."""
    variants = {}
    for section, variant in SERVE_SECTIONS:
        s = merged["sections"].get(section) or {}
        if not s.get("levels") and not s.get("error"):
            continue
        variants[variant] = {
            k: s.get(k)
            for k in ("status", "error", "sizing", "bundle", "time_to_ready_s", "server_args", "levels")
            if s.get(k) is not None
        }
    if not variants:
        return None
    device = ((merged["sections"].get("device") or {}).get("env") or {}).get("device_kind")
    return {"date": merged["date"], "dry_run": merged["dry_run"], "device": device, "variants": variants}


def tables(head: dict) -> list[str]:
    """Markdown: per variant, its sizing line and one table per sweep."""
    out = []
    for variant, v in head["variants"].items():
        size = v.get("sizing") or {}
        out += [f"### {variant} weights", ""]
        out += [
            f"Sizing on {size.get('target') or 'this device'}: {size.get('num_kv_pages', '-')} KV pages of "
            f"{size.get('page_size', '-')} tokens ({size.get('kv_tokens', '-')} tokens, {size.get('kv_gib', '-')} "
            f"GiB), weights {size.get('weights_gib', '-')} GiB, up to {size.get('max_num_seqs', '-')} sequences, "
            f"{size.get('max_num_batched_tokens', '-')} tokens a step, context {size.get('max_model_len', '-')}. "
            f"Ready after {fmt(v.get('time_to_ready_s'))} s "
            f"({'programs loaded from ' + v['bundle'] if v.get('bundle') else 'compiled at start'}).",
            "",
        ]
        if v.get("error"):
            out += ["Error: " + str(v["error"]).strip().splitlines()[-1][:300], ""]
        levels = v.get("levels") or []
        for sweep in dict.fromkeys(r.get("sweep") for r in levels):
            rows = [r for r in levels if r.get("sweep") == sweep]
            first = rows[0]
            out += [f"{sweep}: {first.get('input_len')} prompt / {first.get('output_len')} output tokens", ""]
            out += ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            for r in rows:
                cells = [r.get(k) for k, _ in COLUMNS]
                if "output_throughput" not in r:
                    cells[5] = why(r)
                out.append("| " + " | ".join(fmt(c) for c in cells) + " |")
            out.append("")
    return out


def anchor_lines() -> list[str]:
    out = ["### Published anchors (Llama-3.1-8B, one GPU)", ""]
    for a in ANCHORS:
        figures = {k: v for k, v in a.items() if k not in ("source", "setting", "note")}
        text = "; ".join([f"{k}: {v}" for k, v in figures.items()] + ([a["note"]] if a.get("note") else []))
        out.append(f"- {a['source']}, {a['setting']}: {text}")
    return out + [""]


def plot(head: dict, path: Path) -> bool:
    """Output tok/s and median TPOT against users, one line per variant and sweep, NIM's figures beside them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, v in head["variants"].items():
        levels = [r for r in v.get("levels") or [] if r.get("output_throughput")]
        for sweep in dict.fromkeys(r["sweep"] for r in levels):
            rows = [r for r in levels if r["sweep"] == sweep]
            label = f"{variant} {sweep} ({rows[0]['input_len']}/{rows[0]['output_len']})"
            ax1.plot([r["users"] for r in rows], [r["output_throughput"] for r in rows], "o-", label=label)
            tpot = [(r["users"], r["median_tpot_ms"]) for r in rows if r.get("median_tpot_ms")]
            if tpot:
                ax2.plot(*zip(*tpot, strict=True), "o-", label=label)
    nim = ANCHORS[0]
    ax1.plot(nim["users"], nim["output_tok_s"], "k--", marker="x", label="NVIDIA NIM 1.8 (H100)")
    for ax, ylabel in ((ax1, "output tok/s"), (ax2, "median TPOT ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("users (closed loop)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(f"netra-jax serving, Llama-3.1-8B shapes, {head.get('device') or 'device'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(merged: dict, stem: Path) -> bool:
    """<stem>.json, .md and .png of the sweeps; False when no serving section ran yet."""
    head = headline(merged)
    if head is None:
        return False
    head["anchors"] = ANCHORS
    Path(f"{stem}.json").write_text(json.dumps(head, indent=1) + "\n")
    title = f"# Serving an 8B model, {head['date']}, {head.get('device') or '?'}"
    title += " (DRY RUN: CPU, a tiny Llama)" if head["dry_run"] else ""
    png = plot(head, Path(f"{stem}.png"))
    lines = [title, "", f"![sweeps]({stem.name}.png)" if png else "(no plot: matplotlib missing)", ""]
    Path(f"{stem}.md").write_text("\n".join(lines + tables(head) + anchor_lines()) + "\n")
    return True
