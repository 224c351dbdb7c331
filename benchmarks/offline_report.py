"""Report of an offline-throughput result (benchmarks/offline_throughput.py JSON): the printed table, and a plot of
tokens per second of ours and HF at batch 64 and batch 1 with the fractions of the machine's limits reached.
`python -m benchmarks.offline_report RESULT.json [PLOT.png]` plots a result again."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def print_table(r: dict) -> None:
    f, pk = r["figures"], r["peaks"]
    b, n = r["settings"]["num_prompts"], r["settings"]["max_tokens"]
    rows = [
        ("machine", f"{r['machine'].get('cpu_model')} x{r['machine']['cpu_count']}, load {r['machine']['loadavg']}"),
        (
            "f32 matmul peak",
            f"{pk['matmul_peak_gflops']:.1f} GFLOP/s (numpy {pk['numpy_sgemm']['gflops']:.1f}, "
            f"XLA {pk['xla_dot']['gflops']:.1f})",
        ),
        ("copy bandwidth", f"{pk['bandwidth_gbs']:.1f} GB/s"),
        (
            f"ours  batch {b} x {n}",
            f"{f['ours_tok_s']:.1f} tok/s, {f['ours_total_s']:.2f} s "
            f"(prefill {f['ours_prefill_s']:.2f} s, decode {f['ours_decode_tok_s']:.1f} tok/s)",
        ),
    ]
    if "hf_tok_s" in f:
        rows += [
            (f"HF    batch {b} x {n}", f"{f['hf_tok_s']:.1f} tok/s, {f['hf_total_s']:.2f} s"),
            (
                "ratio ours/HF",
                f"{f['ratio']:.2f} (median of paired runs {f.get('ratio_paired_median', 0):.2f}; "
                f"batch 1: {f['ratio_batch1']:.2f})",
            ),
        ]
        for name in ("batch", "batch1"):
            if f.get(f"quiet_pairs_{name}"):
                rows.append(
                    (
                        f"  quiet pairs, {name}",
                        f"{f[f'quiet_pairs_{name}']}: ours "
                        f"{f[f'ours_tok_s_quiet_{name}']:.1f} / HF {f[f'hf_tok_s_quiet_{name}']:.1f} tok/s = "
                        f"{f[f'ratio_quiet_{name}']:.2f}",
                    )
                )
    elif r.get("hf"):
        rows.append(("HF", str(r["hf"].get("error", r["hf"]))[-300:]))
    rows += [
        (
            "ours fraction of peak",
            f"{100 * f['ours_frac_peak']:.1f}% (decode only "
            f"{100 * f['ours_frac_peak_decode_only']:.1f}%, all FLOPs incl. prefill "
            f"{100 * f['ours_frac_peak_all_flops']:.1f}%)",
        ),
    ]
    if "hf_frac_peak" in f:
        rows.append(("HF fraction of peak", f"{100 * f['hf_frac_peak']:.1f}%"))
    rows.append(
        (
            "batch 1",
            f"ours {f['ours_batch1_tok_s']:.1f} tok/s (decode {f['ours_batch1_decode_tok_s']:.1f}) vs "
            f"bandwidth roofline {f['batch1_roofline_tok_s']:.1f} tok/s = "
            f"{100 * f['ours_batch1_frac_roofline']:.0f}%"
            + (f"; HF {f['hf_batch1_tok_s']:.1f} tok/s" if "hf_batch1_tok_s" in f else ""),
        )
    )
    prof_all = r["ours"].get("profile") or {}
    for name, prof in prof_all.items():
        if not isinstance(prof, dict) or prof.get("decode_step_ms_median") is None:
            continue
        rows.append(
            (
                f"decode step, {name}",
                f"{prof['decode_step_ms_median']:.1f} ms = forward "
                f"{prof['decode_forward_ms_median']:.1f} + sampler {prof['decode_sampler_ms_median']:.1f} + "
                f"host {prof['decode_host_ms_median']:.1f}",
            )
        )
        comp = prof.get("components", {})
        rows.append(
            (
                "  forward parts alone",
                ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in comp.items() if k.endswith("_ms")) or str(comp),
            )
        )
    for m in prof_all.get("matmul_shapes", []):
        shape = "x".join(map(str, m["shape"]))
        rows.append(
            (
                f"  dot {m['name']} {shape}",
                f"XLA {m['xla_gflops']:.0f} GFLOP/s ({m['xla_ms']:.2f} ms), numpy {m['numpy_gflops']:.0f}",
            )
        )
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def plot(result: dict, png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = result["figures"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = [("batch 64 x 128", "tok_s"), ("batch 1", "batch1_tok_s")]
    xs = range(len(groups))
    for off, who, color in ((-0.2, "ours", "tab:blue"), (0.2, "hf", "tab:orange")):
        vals = [f.get(f"{who}_{key}") or 0.0 for _, key in groups]
        bars = a.bar(
            [x + off for x in xs], vals, 0.4, label="netra-jax" if who == "ours" else "HF transformers", color=color
        )
        a.bar_label(bars, fmt="%.0f")
    a.set_xticks(list(xs), [g for g, _ in groups])
    a.set_ylabel("output tokens / s")
    a.set_title(f"throughput (ours / HF = {f.get('ratio', float('nan')):.2f} at batch 64)")
    a.legend()
    fr = [
        ("ours: matmul peak", f.get("ours_frac_peak")),
        ("ours: peak, all FLOPs", f.get("ours_frac_peak_all_flops")),
        ("HF: matmul peak", f.get("hf_frac_peak")),
        ("ours batch 1: bandwidth", f.get("ours_batch1_frac_roofline")),
        ("HF batch 1: bandwidth", f.get("hf_batch1_frac_roofline")),
    ]
    fr = [(k, v) for k, v in fr if v is not None]
    bars = b.barh([k for k, _ in fr], [100 * v for _, v in fr], color="tab:green")
    b.bar_label(bars, fmt="%.0f%%")
    b.axvline(70, color="grey", ls="--", lw=1)
    b.set_xlim(0, 100)
    b.invert_yaxis()
    b.set_title("fraction of the machine's limit (goal: 70%)")
    peaks = result["peaks"]
    m = result["machine"]
    fig.suptitle(
        f"Offline, SmolLM2-135M f32, {m.get('cpu_model')} x{m.get('cpu_count')}: matmul peak "
        f"{peaks['matmul_peak_gflops']:.0f} GFLOP/s, copy bandwidth {peaks['bandwidth_gbs']:.1f} GB/s "
        f"({result['date'][:10]})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


if __name__ == "__main__":
    src = Path(sys.argv[1])
    print(plot(json.loads(src.read_text()), sys.argv[2] if len(sys.argv) > 2 else src.with_suffix(".png")))
