"""The compile check's report for one target: the JSON of every kernel case and step program, and a markdown file of
the two tables (kernel configurations with registers, spills and shared memory; step programs with compile time and
memory analysis against the memory sizing's margin), failures first."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30


def failed(row: dict) -> bool:
    return bool(row.get("problems"))


def summary(result: dict) -> dict:
    kernels, steps = result.get("kernels", []), result.get("steps", [])
    return {
        "kernel_cases": len(kernels),
        "kernel_cases_failed": sum(map(failed, kernels)),
        "step_programs": len(steps),
        "step_programs_failed": sum(map(failed, steps)),
        "max_registers": max((r["registers"] for r in kernels if r.get("registers")), default=None),
        "max_smem_bytes": max((r["smem_bytes"] for r in kernels if r.get("smem_bytes")), default=None),
        "max_temp_gib": max((r["memory"]["temp_bytes"] / GIB for r in steps if "memory" in r), default=None),
        "steps_not_graph_captured": sum(1 for r in steps if "anatomy" in r and not r["anatomy"]["graph_captured"]),
    }


def write(result: dict, out_dir: Path) -> Path:
    stem = out_dir / f"{result['date'][:10]}-gpu_compile-{result['target']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(result))
    return stem


def _cfg(row: dict) -> str:
    if "gemms" in row:  # a product XLA compiled: what its GEMM reads instead of a Pallas configuration
        return kernel_line(row)
    c = row.get("config") or {}
    if row.get("kernel") == "mosaic":
        p = ", P in regs" if c.get("p_in_registers") else ""
        return f"rows {c['block_rows']}, tile {c['tile']}, {c['num_stages']} stages, {c['num_splits']} splits{p}"
    if row.get("kernel") in ("grouped_matmul", "packed_matmul"):
        return f"block {c['block_m']}x{c['block_n']}x{c['block_k']}, {c['num_warps']} warps, {c['num_stages']} stages"
    if c:
        return f"block_m {c['block_m']}, tile {c['tile']}, {c['num_splits']} splits, {c['num_warps']} warps, " + (
            f"{c['num_stages']} stages"
        )
    return "-"


def _verdict(row: dict) -> str:
    return "; ".join(row["problems"]).replace("\n", " ")[:300] if failed(row) else "ok"


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def kernel_line(row: dict) -> str:
    """One case's figures, for progress lines and the table."""
    if "gemms" in row:  # a product XLA compiled (jobs.judge_gemm)
        where = row["fp8_gemm"] or "no fp8 GEMM"
        widened = f", weight copied: {row['weight_copies'][0]}" if row["weight_copies"] else ""
        return f"{where}, {row['temp_bytes'] / 2**20:.1f} MiB temporaries{widened}"
    if "registers" not in row:
        return _verdict(row)
    smem = "-" if row.get("smem_bytes") is None else f"{row['smem_bytes'] / 1024:.1f} KiB"
    return f"{row['registers']} registers, {row['spill_bytes']} B spilled, {smem} shared"


def step_line(row: dict) -> str:
    if "memory" not in row:
        return _verdict(row)
    m, z = row["memory"], row["sizing"]
    return (
        f"{row['compile_s']:.1f}s, temp {_gib(m['temp_bytes'])} GiB of a {_gib(z['activation_margin_bytes'])} GiB "
        f"margin, {len(row['pallas_kernels'])} Pallas kernels"
    )


def markdown(result: dict) -> str:
    s = result["summary"]
    out = [
        f"# GPU compile check: {result['target']} ({result['arch']}), {result['date']}",
        "",
        f"Deviceless compile on {result['host']} (jax {result['jax']}, {result['workers']} compiling processes, "
        f"{result['seconds']:.0f} s). Kernel cases: {s['kernel_cases']} ({s['kernel_cases_failed']} failed); step "
        f"programs: {s['step_programs']} ({s['step_programs_failed']} failed).",
        "",
        "## Kernel configurations",
        "",
        "| case | configuration | registers | spill B | shared KiB | compile s | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in sorted(result.get("kernels", []), key=lambda r: not failed(r)):
        smem = "-" if r.get("smem_bytes") is None else f"{r['smem_bytes'] / 1024:.1f}"
        cells = [r.get("case", "?"), _cfg(r), r.get("registers", "-"), r.get("spill_bytes", "-"), smem]
        cells += [r.get("compile_s", "-"), _verdict(r)]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out += [
        "",
        "## Step programs",
        "",
        "Every step variant the engine's warm-up compiles, abstract bf16 weights; memory against the engine's sizing "
        "(allocator limit x gpu_memory_utilization, less the weights; the KV cache takes KV_SHARE of the rest, the "
        "activations the margin). Launches: the kernels and library calls one step runs (its thunk sequence after "
        "XLA's passes, per layer of the layers compiled), and the host's launches for them (1: the whole step is one "
        "command buffer, a CUDA graph).",
        "",
        "| model | tokens | seqs | rows | backend | compile s | arguments GiB | temp GiB | margin GiB | launches "
        "(per layer) | host launches | Pallas kernels | verdict |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(result.get("steps", []), key=lambda r: not failed(r)):
        m, z = r.get("memory") or {}, r.get("sizing") or {}
        rows = r.get("logit_rows", "-")
        if r.get("prompt_rows"):
            rows = f"{rows} + {r['prompt_rows']} prompt"
        cells = [r.get("model", "?"), r.get("num_tokens", "-"), r.get("num_seqs", "-"), rows, r.get("backend", "-")]
        cells += [r.get("compile_s", "-"), _gib(m.get("argument_bytes")), _gib(m.get("temp_bytes"))]
        a = r.get("anatomy") or {}
        launches = f"{a['launches']} ({a['launches_per_layer']})" if a else "-"
        cells += [_gib(z.get("activation_margin_bytes")), launches, a.get("host_launches", "-")]
        cells += [", ".join(r.get("pallas_kernels", [])) or "-", _verdict(r)]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"
