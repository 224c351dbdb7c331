"""The phases of a long benchmark run, each timed with the load average and the CPU other processes took meanwhile,
and the head of its result (name, date, machine, phases); used where ours and a baseline alternate under one load."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import numpy as np

QUIET_CORES = 0.2  # a run counts as quiet when other processes used less CPU than this on average


def _cpu_busy(pids: tuple[int, ...] = ()) -> tuple[float, float]:
    """(whole-machine busy CPU seconds, CPU seconds of this process, its reaped children and `pids`)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    t = os.times()
    mine = t.user + t.system + t.children_user + t.children_system
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            mine += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return (sum(v[:8]) - v[3] - v[4]) / tick, mine


class Phase:
    """Times a phase and records the load average and the CPU seconds other processes used meanwhile."""

    children: list[int] = []  # our live subprocesses: their CPU time is ours, not others'

    def __init__(self, log: dict, name: str):
        self.log, self.name = log, name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), _cpu_busy(tuple(self.children))
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        c1 = _cpu_busy(tuple(self.children))
        other = (c1[0] - self.c0[0]) - (c1[1] - self.c0[1])
        self.rec = {
            "wall_s": round(dt, 3),
            "load1": round(os.getloadavg()[0], 2),
            "others_cores": round(max(0.0, other) / dt, 2) if dt > 0 else None,
        }
        self.log[self.name] = self.rec
        print(
            f"[{self.name}] {dt:.1f} s, load {self.rec['load1']}, others {self.rec['others_cores']} cores",
            file=sys.stderr,
            flush=True,
        )


def machine_info() -> dict:
    """CPU model, core count, memory and the 1/5/15-minute load average at the time of the call."""
    info: dict = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
    except OSError:
        pass
    info["loadavg"] = list(os.getloadavg())
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except ImportError:
        pass
    info["numpy"] = np.__version__
    return info


def run_record(benchmark: str, phases: dict) -> dict:
    """The head of a benchmark's result JSON: its name, the date, the machine, and `phases` (filled by `Phase`)."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "phases": phases,
    }
