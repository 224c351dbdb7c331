"""Section `serve_fp8`: the `serve` section's sweeps with the weights quantized to fp8 at load (`--quantization fp8`),
from the fp8 bundle when the device run carries one."""

from __future__ import annotations

from benchmarks.gpu_check import engine_settings
from benchmarks.gpu_check.common import Section
from benchmarks.gpu_check.serve import run_variant


def run(sec: Section) -> None:
    run_variant(sec, engine_settings.VARIANTS[1])
