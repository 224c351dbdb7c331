"""The compiled programs the device run carries (`netra-jax compile` for a GPU target, without a GPU): the serving
model of `engine_settings` for each target and weight variant, into BUNDLES/<target>-<variant>/, which the serve and
model sections load instead of compiling when they find their device's.

Usage: python -m benchmarks.gpu_check.bundles [--targets h100] [--variants bf16,fp8] [--out DIR] [--results DIR]
(jax's CUDA plugin importable: `make gpu-bundles`); prints each bundle's programs, seconds and size, and with
--results writes them (per program: kind, bytes, compile seconds) to DIR/<date>-gpu_bundle-<target>-<variant>.json
and .md."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only devices come from the CUDA plugin, not a GPU

from benchmarks.gpu_check import engine_settings  # noqa: E402
from benchmarks.gpu_check.model_dir import ensure_model_dir  # noqa: E402

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"  # benchmarks/bundles (git-ignored, carried to the device)


def bundle_dir(target: str, variant: str, root: Path = BUNDLES) -> Path:
    return root / f"{target}-{variant}"


def carried(target: str | None, variant: str) -> Path | None:
    """The bundle built for `target` and `variant` if the run carries it (None: the engine compiles)."""
    found = bundle_dir(target or "-", variant)
    return found if (found / "manifest.json").is_file() else None


def build(target: str, variant: engine_settings.Variant, model: Path, out: Path) -> dict:
    """Compile the serving model's programs for `target` with `variant`'s weights into `out`; the manifest."""
    from netra_jax.engine.aot import compile_bundle

    size = engine_settings.sizing(model, target, False, variant.quantization)
    config = engine_settings.engine_config(
        model, False, quantization=variant.quantization, num_kv_pages=size["num_kv_pages"]
    )
    return compile_bundle(config, target, out, progress=lambda line: None)


def record(manifest: dict, seconds: float, results: Path, target: str, variant: str) -> Path:
    """The bundle's figures as a result file: what was compiled, how big, how long, on which host."""
    import datetime
    import json

    from netra_jax.bench.machine import describe, machine_info

    programs = manifest["programs"]
    kinds: dict[str, dict] = {}
    for p in programs:
        k = kinds.setdefault(p["kind"], {"programs": 0, "bytes": 0, "compile_s": 0.0})
        k["programs"] += 1
        k["bytes"] += p["bytes"]
        k["compile_s"] = round(k["compile_s"] + p["compile_s"], 1)
    out = {
        "check": "gpu_bundle",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": describe(machine_info()),
        "target": target,
        "variant": variant,
        "wall_s": round(seconds, 1),
        "bytes": sum(p["bytes"] for p in programs),
        "kinds": kinds,
        "compiler_options": manifest.get("compiler_options"),
        "signature": manifest["signature"],
        "programs": [{k: p[k] for k in ("kind", "label", "bytes", "compile_s")} for p in programs],
    }
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{out['date'][:10]}-gpu_bundle-{target}-{variant}"
    Path(f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        f"# Compiled programs for {target} ({variant} weights), {out['date']}",
        "",
        f"`python -m benchmarks.gpu_check.bundles --targets {target} --variants {variant}` on {out['host']}: "
        f"{len(programs)} programs in {out['wall_s']} s wall, {out['bytes'] / 2**20:.1f} MiB (lzma), XLA options "
        f"{out['compiler_options']}.",
        "",
        "| kind | programs | MiB | compile s (summed over threads) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {v['programs']} | {v['bytes'] / 2**20:.2f} | {v['compile_s']} |" for k, v in kinds.items()]
    lines += ["", "| program | kind | KiB | compile s |", "|---|---|---:|---:|"]
    lines += [f"| {p['label']} | {p['kind']} | {p['bytes'] / 1024:.0f} | {p['compile_s']} |" for p in programs]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="h100")
    ap.add_argument("--variants", default="bf16")
    ap.add_argument("--out", default=str(BUNDLES))
    ap.add_argument("--results", default=None, help="write each bundle's figures to this directory")
    a = ap.parse_args(argv)
    variants = {v.name: v for v in engine_settings.VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_model_dir(Path(tmp), dry=False)
        for target in a.targets.split(","):
            for name in a.variants.split(","):
                t0 = time.perf_counter()
                out = bundle_dir(target, name, Path(a.out))
                manifest = build(target, variants[name], model, out)
                seconds = time.perf_counter() - t0
                size = sum(p["bytes"] for p in manifest["programs"])
                count = len(manifest["programs"])
                print(f"{out}: {count} programs in {seconds:.0f}s, {size / 2**20:.1f} MiB", flush=True)
                if a.results:
                    print(f"figures: {record(manifest, seconds, Path(a.results), target, name)}.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
