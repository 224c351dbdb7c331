"""Reads a step trace (engine/step_trace.py) back and summarizes it: what the steps that carried decodes cost, how much
of a decoding sequence's time went to steps with prefill, padding, and where the CPU went (XLA, engine, server).

Usage: `python -m netra_jax.engine.step_report trace.jsonl [--steps A:B] [--json]`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

__all__ = ["format_summary", "main", "read_trace", "summarize"]


def read_trace(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(config line, step lines) of a trace file."""
    config, steps = {}, []
    for text in Path(path).read_text().splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        if line.get("kind") == "config":
            config = line
        elif line.get("kind") == "step":
            steps.append(line)
    return config, steps


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def step_ms(s: dict) -> float:
    """A step's time: its period, or (the first step after idle, which has none) its device time."""
    return s["period_ms"] if s.get("period_ms") is not None else s["device_ms"]


def _cpu_split(steps: list[dict]) -> dict[str, float] | None:
    """Mean CPU ms a step of the process, XLA's threads, the engine thread and the rest (server threads)."""
    if not steps or any(s.get("call_xla_cpu_ms") is None for s in steps):
        return None
    process = _mean(s["call_cpu_ms"] for s in steps)
    xla = _mean(s["call_xla_cpu_ms"] for s in steps)
    engine = _mean(s["call_engine_cpu_ms"] for s in steps)
    return {"process": process, "xla": xla, "engine": engine, "other": process - xla - engine}


def summarize(steps: list[dict]) -> dict:
    """What a trace says about its steps. `decode_weighted_ms`: the mean step time over decode tokens (a decode in a
    long step counts as long): the model of TPOT; `decode_time_in_mixed_steps`: the share of it spent in steps that
    also carried prefill; `padding_share`: padded tokens over bucket tokens; per (bucket, with prefill) the count,
    mean tokens, step time and CPU."""
    dec = [s for s in steps if s["decode"]]
    mixed = [s for s in dec if s["prefill"]]
    pure = [s for s in dec if not s["prefill"]]
    dec_tokens = sum(s["decode"] for s in dec)
    total = sum(step_ms(s) for s in steps)
    dec_time = sum(s["decode"] * step_ms(s) for s in dec)
    groups: dict[tuple[int, bool], list[dict]] = {}
    for s in steps:
        groups.setdefault((s["bucket"], bool(s["prefill"])), []).append(s)
    buckets = [
        {
            "bucket": bucket,
            "prefill": prefill,
            "steps": len(ss),
            "mean_tokens": _mean(s["tokens"] for s in ss),
            "mean_decode": _mean(s["decode"] for s in ss),
            "mean_ms": _mean(step_ms(s) for s in ss),
            "mean_device_ms": _mean(s["device_ms"] for s in ss),
            "cpu_ms": _cpu_split(ss) or {"process": _mean(s["call_cpu_ms"] for s in ss)},
            "share_of_time": sum(step_ms(s) for s in ss) / total if total else 0.0,
        }
        for (bucket, prefill), ss in sorted(groups.items())
    ]
    return {
        "steps": len(steps),
        "total_s": total / 1e3,
        "decode_steps": len(dec),
        "mixed_steps": len(mixed),
        "decode_tokens": dec_tokens,
        "prefill_tokens": sum(s["prefill"] for s in steps),
        "padding_share": sum(s["padding"] for s in steps) / max(1, sum(s["bucket"] for s in steps)),
        "pure_decode_ms": _mean(step_ms(s) for s in pure),
        "mixed_ms": _mean(step_ms(s) for s in mixed),
        "decode_weighted_ms": dec_time / max(1, dec_tokens),
        "decode_time_in_mixed_steps": sum(s["decode"] * step_ms(s) for s in mixed) / dec_time if dec_time else 0.0,
        "host_share": sum(min(s["call_host_ms"], step_ms(s)) for s in steps) / total if total else 0.0,
        "cpu_ms": _cpu_split(steps),
        "buckets": buckets,
    }


def _cpu_text(cpu: dict | None) -> str:
    if cpu is None:
        return "-"
    if "xla" not in cpu:
        return f"{cpu['process']:.0f}"
    return f"{cpu['process']:.0f} ({cpu['xla']:.0f} / {cpu['engine']:.0f} / {cpu['other']:.0f})"


def format_summary(summary: dict, config: dict | None = None) -> str:
    s = summary
    lines = []
    if config:
        lines.append(
            f"buckets {config.get('buckets')}; max_num_batched_tokens {config.get('max_num_batched_tokens')}, "
            f"max_num_seqs {config.get('max_num_seqs')}; {config.get('cpu')} x{config.get('num_cpus')}"
        )
    lines += [
        f"{s['steps']} steps in {s['total_s']:.1f} s; {s['decode_steps']} carried decodes, {s['mixed_steps']} of "
        f"them also prefill; {s['decode_tokens']} decode and {s['prefill_tokens']} prefill tokens; padding "
        f"{100 * s['padding_share']:.0f}% of bucket tokens; engine host work {100 * s['host_share']:.0f}% of the time",
        f"step time per decode token {s['decode_weighted_ms']:.1f} ms (pure decode steps {s['pure_decode_ms']:.1f} ms, "
        f"with prefill {s['mixed_ms']:.1f} ms); {100 * s['decode_time_in_mixed_steps']:.0f}% of decode time is spent "
        "in steps with prefill",
        f"CPU ms a step: process (XLA / engine thread / other threads) {_cpu_text(s['cpu_ms'])}",
        "",
        "| bucket | prefill | steps | tokens | decode | step ms | device ms | CPU ms (XLA / engine / other) | share |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in s["buckets"]:
        lines.append(
            f"| {b['bucket']} | {'yes' if b['prefill'] else 'no'} | {b['steps']} | {b['mean_tokens']:.0f} | "
            f"{b['mean_decode']:.1f} | {b['mean_ms']:.1f} | {b['mean_device_ms']:.1f} | {_cpu_text(b['cpu_ms'])} | "
            f"{100 * b['share_of_time']:.0f}% |"
        )
    return "\n".join(lines)


def _step_range(text: str) -> slice:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected A:B (either may be empty), got {text!r}")
    try:
        return slice(int(lo) if lo else None, int(hi) if hi else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers in A:B, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize a step trace (NETRA_STEP_TRACE=trace.jsonl)")
    ap.add_argument("trace")
    ap.add_argument("--steps", type=_step_range, default=slice(None), help="A:B: only steps A <= step < B")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    config, steps = read_trace(a.trace)
    lo, hi = a.steps.start, a.steps.stop
    steps = [s for s in steps if (lo is None or s["step"] >= lo) and (hi is None or s["step"] < hi)]
    if not steps:
        raise SystemExit(f"{a.trace}: no steps in that range")
    summary = summarize(steps)
    print(json.dumps(summary, indent=1) if a.json else format_summary(summary, config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
