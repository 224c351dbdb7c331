"""What a deviceless compile reports about its GPU kernels, read from the compilers' own output: ptxas `-v` (registers,
spills, static shared memory of every kernel, Mosaic GPU's and XLA's alike), Mosaic GPU's resource estimate (its
dynamic shared memory) and XLA's thunk sequence (each launched kernel's dynamic shared memory, Triton's included).

`compiler_env` is the environment a compiling process starts with (the compilers read it once, at start-up);
`captured` collects what they print to the process's stdout and stderr around one compile."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# the module name of programs whose launches are dumped (the thunk sequence holds Triton's dynamic shared memory)
DUMPED_MODULE = "kernel_case"


def compiler_env(dump_dir: str) -> dict[str, str]:
    """Variables that make the compilers report: Mosaic GPU prints ptxas -v and its resources, XLA passes -v to ptxas
    and logs the report (subprocess_compilation at verbosity 2), and dumps the thunk sequence of `DUMPED_MODULE`
    programs to `dump_dir`. Autotuning is off: without a device nothing can be timed, so XLA keeps its default GEMM
    choices anyway, after generating and compiling the candidates (a third of a step program's compile; the kernels,
    their reports and the memory analysis come out the same)."""
    flags = [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_gpu_autotune_level=0",
        "--xla_gpu_ptx_compiler_extra_flags=-v",
        f"--xla_dump_to={dump_dir}",
        f"--xla_dump_hlo_module_re={DUMPED_MODULE}",
    ]
    return {
        "JAX_PLATFORMS": "cpu",  # the CUDA backend cannot start without a driver; the plugin still serves topologies
        "MOSAIC_GPU_DUMP_PTXAS": "1",
        "MOSAIC_GPU_DUMP_RESOURCES": "1",
        "TF_CPP_MIN_LOG_LEVEL": "0",
        "TF_CPP_VMODULE": "subprocess_compilation=2",
        "XLA_FLAGS": " ".join(f for f in flags if f),
    }


@dataclass
class Captured:
    text: str = ""


@contextlib.contextmanager
def captured():
    """Everything written to file descriptors 1 and 2 inside the block (the compilers write there, below Python),
    returned in `.text` after it."""
    out = Captured()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            out.text = tmp.read().decode(errors="replace")


@dataclass
class KernelReport:
    """ptxas' report on one kernel."""

    name: str
    arch: str
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    static_smem: int = 0
    dynamic_smem: int | None = None  # filled from Mosaic's resources or XLA's thunk sequence

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def smem_bytes(self) -> int | None:
        return None if self.dynamic_smem is None else self.dynamic_smem + self.static_smem

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "arch": self.arch,
            "registers": self.registers,
            "spill_bytes": self.spill_bytes,
            "stack_bytes": self.stack_bytes,
            "smem_bytes": self.smem_bytes,
        }


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_RESOURCES = re.compile(r"Resources\(smem_scratch_bytes=(\d+)")
_THUNK = re.compile(r"\] (\S+) grid: \[[^\]]*\] threads: \[[^\]]*\]\s+shared_memory: (\d+) bytes")


def ptxas_reports(text: str) -> list[KernelReport]:
    """Every kernel ptxas reported on in `text`, once each, in order (Mosaic GPU's kernels are reported twice, by
    XLA's log of the ptxas call and by Mosaic itself; identical kernels of one program are one report)."""
    reports: list[KernelReport] = []
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            reports.append(KernelReport(m.group(1), m.group(2)))
        elif not reports:
            continue
        elif m := _PROPS.search(line):
            r = reports[-1]
            r.stack_bytes, r.spill_stores, r.spill_loads = (int(g) for g in m.groups())
        elif m := _USED.search(line):
            reports[-1].registers = int(m.group(1))
            if s := _SMEM.search(line):
                reports[-1].static_smem = int(s.group(1))
    return list({r.name: r for r in reports}.values())


def mosaic_smem(text: str) -> list[int]:
    """Mosaic GPU's shared-memory scratch of each kernel it lowered, in order."""
    return [int(m.group(1)) for m in _RESOURCES.finditer(text)]


def thunk_smem(dump_dir: str | os.PathLike, before: set[str]) -> dict[str, int]:
    """Dynamic shared memory of every kernel launched by the programs dumped since `before` (the thunk-sequence
    files present then)."""
    out: dict[str, int] = {}
    for path in sorted(Path(dump_dir).glob("*.thunk_sequence.txt")):
        if path.name in before:
            continue
        for m in _THUNK.finditer(path.read_text()):
            out[m.group(1)] = int(m.group(2))
    return out


def dumped(dump_dir: str | os.PathLike) -> set[str]:
    return {p.name for p in Path(dump_dir).glob("*.thunk_sequence.txt")}


@dataclass
class Compiled:
    """One program's compile: its kernels as ptxas saw them and the compilers' output (for errors)."""

    kernels: list[KernelReport] = field(default_factory=list)
    text: str = ""

    def find(self, prefix: str) -> list[KernelReport]:
        return [k for k in self.kernels if k.name.startswith(prefix)]


def errors_in(text: str, limit: int = 1500) -> str:
    """The compilers' error lines of `text` (ptxas errors, XLA's), for a failed compile's message."""
    lines = [ln for ln in text.splitlines() if re.search(r"error|Error|ERROR|fatal", ln)]
    return "\n".join(lines)[-limit:]


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(?[a-z0-9]+)\[")
_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = [^=]*? dot\(%([^,\s)]+), %([^,\s)]+)")
_CUBLAS = re.compile(r'custom-call\(%([^,\s)]+), %([^,\s)]+).*custom_call_target="(__cublas[^"]*)"')


def gemms(hlo: str) -> list[tuple[str, str, str]]:
    """The matrix products of a compiled HLO module as (where, lhs element type, rhs element type): where is
    "cublas:<custom-call target>" for a cuBLAS(Lt) call, "dot" for a dot inside a fusion (XLA's Triton GEMMs, whose
    operands are the fusion's loads: an f8e4m3fn operand there is read as fp8)."""
    types = {m.group(1): m.group(2).lstrip("(") for line in hlo.splitlines() if (m := _INSTR.match(line))}
    out = []
    for line in hlo.splitlines():
        if m := _CUBLAS.search(line):
            out.append((f"cublas:{m.group(3)}", types.get(m.group(1), "?"), types.get(m.group(2), "?")))
        elif m := _DOT.match(line):
            out.append(("dot", types.get(m.group(1), "?"), types.get(m.group(2), "?")))
    return out


_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = ([a-z0-9]+)\[([\d,]*)\]\S* ([\w-]+)\(")


def entry_buffers(hlo: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """The arrays the ENTRY computation of a compiled HLO module produces (name, element type, dims, op), parameters
    and bitcasts (no buffer of their own) left out: what its programs write to device memory."""
    out, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside and (m := _ENTRY_OP.match(line)) and m.group(4) not in ("parameter", "bitcast"):
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            out.append((m.group(1), m.group(2), dims, m.group(4)))
    return out
