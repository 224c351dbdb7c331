"""Plots of serving benchmark result files: output token throughput, TTFT and TPOT against max concurrency (or
request rate when only the rate varies), one line per engine; medians solid, p99 dashed."""

from __future__ import annotations

import math
from pathlib import Path


def _axis(runs: list[dict]) -> tuple[str, list[float], list[str]]:
    """The swept quantity: ('max concurrency' | 'request rate (req/s)', x positions, tick labels)."""
    concs = [r.get("max_concurrency") for r in runs]
    rates = [r.get("request_rate") for r in runs]
    if len(set(concs)) > 1 or len(set(rates)) <= 1:
        xs = [float(c) if c else float(r.get("num_requests") or 1) for c, r in zip(concs, runs, strict=True)]
        return "max concurrency", xs, [str(c) if c else "all" for c in concs]
    finite = [float(r) for r in rates if r not in (None, "inf") and math.isfinite(float(r))]
    top = max(finite, default=1.0) * 2
    xs = [top if r in (None, "inf") or not math.isfinite(float(r)) else float(r) for r in rates]
    return "request rate (req/s)", xs, ["inf" if x == top else f"{x:g}" for x in xs]


def plot(results: list[dict], labels: list[str], out: str | Path) -> Path:
    """One PNG, three panels, a colour per result file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [
        ("output token throughput (tok/s)", [("output_throughput", "-", "")]),
        ("TTFT (ms)", [("median_ttft_ms", "-", " median"), ("p99_ttft_ms", "--", " p99")]),
        ("TPOT (ms)", [("median_tpot_ms", "-", " median"), ("p99_tpot_ms", "--", " p99")]),
    ]
    xlabel, ticks = "max concurrency", {}
    for i, (res, label) in enumerate(zip(results, labels, strict=True)):
        runs = res.get("runs", [])
        if not runs:
            continue
        xlabel, xs, names = _axis(runs)
        ticks.update(zip(xs, names, strict=True))
        order = sorted(range(len(xs)), key=xs.__getitem__)
        colour = f"C{i}"
        for ax, (_, series) in zip(axes, panels, strict=True):
            for key, style, suffix in series:
                pts = [(xs[j], runs[j].get(key)) for j in order if runs[j].get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", color=colour, label=label + suffix)
    model = next((r.get("config", {}).get("model") for r in results if r.get("config")), None)
    for ax, (title, _) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        if len(ticks) > 1 and min(ticks) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if model:
        fig.suptitle(f"serving benchmark: {model}")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown_table(results: list[dict], labels: list[str]) -> str:
    """One row per swept point and result file (grouped by point): output tok/s, median TTFT and TPOT, failures; and
    the draft acceptance rate and mean acceptance length when any pass has speculative decoding counts."""
    num = lambda v, f: "-" if v is None else format(v, f)
    spec = any(r.get("spec_decode") for res in results for r in res.get("runs", []))
    rows = []
    for i, (res, label) in enumerate(zip(results, labels, strict=True)):
        for j, r in enumerate(res.get("runs", [])):
            conc, rate = r.get("max_concurrency"), r.get("request_rate")
            key = (conc or math.inf, math.inf if rate in (None, "inf") else float(rate), i, j)
            cells = [
                str(conc or "all"),
                "inf" if rate in (None, "inf") else f"{float(rate):g}",
                label,
                num(r.get("output_throughput"), ".1f"),
                num(r.get("median_ttft_ms"), ".1f"),
                num(r.get("median_tpot_ms"), ".2f"),
            ]
            if spec:
                sd = r.get("spec_decode") or {}
                cells += [num(sd.get("acceptance_rate"), ".1%"), num(sd.get("mean_acceptance_length"), ".2f")]
            rows.append((key, [*cells, str(r.get("failed", 0))]))
    head = ["max concurrency", "request rate", "engine", "output tok/s", "median TTFT ms", "median TPOT ms"]
    head += ["draft acceptance", "mean acceptance length"] if spec else []
    head.append("failed")
    lines = ["| " + " | ".join(head) + " |", "| ---: | ---: | --- |" + " ---: |" * (len(head) - 3)]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in sorted(rows, key=lambda kv: kv[0])]
    return "\n".join(lines) + "\n"
