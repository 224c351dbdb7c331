"""The machine a benchmark ran on, recorded in every result file: CPU model, core counts, the instruction-set flags that
decide CPU speed (AVX2, AVX-512, FMA, AMX, VNNI), memory, OS and the jax / jaxlib versions installed."""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path

# /proc/cpuinfo flags that change which kernels XLA and llama.cpp can use (prefixes: avx512* and amx* cover all).
SPEED_FLAG_PREFIXES = ("avx512", "amx")
SPEED_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx_vnni_int8", "avx_ne_convert")


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as {field: value} (later blocks repeat it on these machines)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def speed_flags(flags: str) -> list[str]:
    """The speed-relevant flags among a cpuinfo 'flags' line, sorted."""
    have = set(flags.split())
    keep = {f for f in have if f in SPEED_FLAGS or f.startswith(SPEED_FLAG_PREFIXES)}
    return sorted(keep)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _memory_gib() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemTotal:\s+(\d+) kB", text, re.M)
    return round(int(m.group(1)) / 2**20, 1) if m else None


def machine_info(cpuinfo_path: str | Path = "/proc/cpuinfo") -> dict:
    """What the result of a benchmark depends on besides the code: a JSON-ready dict."""
    try:
        fields = cpuinfo_fields(Path(cpuinfo_path).read_text(errors="replace"))
    except OSError:
        fields = {}
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    cores = fields.get("cpu cores")
    return {
        "cpu_model": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_vendor": fields.get("vendor_id"),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,  # this process's CPU affinity (containers and taskset limit it)
        "cores_per_socket": int(cores) if cores and cores.isdigit() else None,
        "cpu_flags": speed_flags(fields.get("flags", "")),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
    }


def describe(info: dict) -> str:
    """One line for reports: 'Intel Xeon ..., 2 CPUs, avx2 avx512f ... amx_tile, jax 0.x'."""
    flags = info.get("cpu_flags") or []
    wide = [f for f in flags if f in ("avx2", "fma") or f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")]
    isa = " ".join(wide) + ("" if "avx512f" in flags else " (no AVX-512)")
    return (
        f"{info.get('cpu_model') or 'unknown CPU'}, {info.get('usable_cpus')} CPUs, {isa.strip()}, "
        f"jax {info.get('jax')} / jaxlib {info.get('jaxlib')}"
    )
