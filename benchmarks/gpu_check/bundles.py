"""The compiled programs the device run carries (`netra-jax compile` for a GPU target, without a GPU): the serving
model of `engine_settings` for each target and weight variant, into BUNDLES/<target>-<variant>/, which the serve and
model sections load instead of compiling when they find their device's.

Usage: python -m benchmarks.gpu_check.bundles [--targets h100] [--variants bf16,fp8] [--out DIR] (jax's CUDA plugin
importable: `make gpu-bundles`); prints each bundle's programs, seconds and size."""

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="h100")
    ap.add_argument("--variants", default="bf16")
    ap.add_argument("--out", default=str(BUNDLES))
    a = ap.parse_args(argv)
    variants = {v.name: v for v in engine_settings.VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_model_dir(Path(tmp), dry=False)
        for target in a.targets.split(","):
            for name in a.variants.split(","):
                t0 = time.perf_counter()
                out = bundle_dir(target, name, Path(a.out))
                manifest = build(target, variants[name], model, out)
                size = sum(p["bytes"] for p in manifest["programs"])
                print(
                    f"{out}: {len(manifest['programs'])} programs in {time.perf_counter() - t0:.0f}s, "
                    f"{size / 2**20:.1f} MiB",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
