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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# the module name of programs whose launches are dumped (the thunk sequence holds Triton's dynamic shared memory)
DUMPED_MODULE = "kernel_case"
STEP_MODULE = "jit__step"  # the engine's step program: its thunk sequence is its launches per step (`step_anatomy`)


def compiler_env(dump_dir: str) -> dict[str, str]:
    """Variables that make the compilers report: Mosaic GPU prints ptxas -v and its resources, XLA passes -v to ptxas
    and logs the report (subprocess_compilation at verbosity 2), and dumps the thunk sequence of `DUMPED_MODULE`
    and step programs to `dump_dir`. Autotuning is off: without a device nothing can be timed, so XLA keeps its
    default GEMM choices anyway, after generating and compiling the candidates (a third of a step program's
    compile; the kernels, their reports and the memory analysis come out the same)."""
    flags = [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_gpu_autotune_level=0",
        "--xla_gpu_ptx_compiler_extra_flags=-v",
        f"--xla_dump_to={dump_dir}",
        f"--xla_dump_hlo_module_re={DUMPED_MODULE}|{STEP_MODULE}",
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
    return {p.name for p in Path(dump_dir).glob("*.thunk_sequence*.txt")}


def step_thunks(dump_dir: str | os.PathLike, before: set[str]) -> str | None:
    """The thunk sequence (after XLA's thunk passes: what runs) of the step program dumped since `before`."""
    new = [
        p for p in Path(dump_dir).glob(f"*{STEP_MODULE}*.thunk_sequence_after_thunk_passes.txt") if p.name not in before
    ]
    return max(new, key=lambda p: p.stat().st_mtime).read_text() if new else None


_THUNK_LINE = re.compile(r"^( *)\d+: (k\w+)", re.MULTILINE)
# thunks that hold others: a command buffer (one CUDA graph launch), a dynamic-slice fusion (a custom call on slices
# of its buffers), control flow
CONTAINERS = frozenset({"kCommandBuffer", "kDynamicSliceFusion", "kSequential", "kWhile", "kConditional"})


def step_anatomy(thunks: str, layers: int) -> dict:
    """What one execution of a program launches, from its thunk sequence: the kernels and library calls (`launches`,
    by thunk kind, and per layer), how many of them a command buffer (a CUDA graph: one launch from the host)
    captures, and the host-side launches left (`host_launches`: the command buffers plus every launch outside one)."""
    stack: list[tuple[int, str]] = []
    launches: Counter[str] = Counter()
    captured = outside = buffers = 0
    for m in _THUNK_LINE.finditer(thunks):
        indent, kind = len(m[1]), m[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        in_buffer = any(k == "kCommandBuffer" for _, k in stack)
        if kind == "kCommandBuffer" and not in_buffer:
            buffers += 1
        if kind in CONTAINERS:
            stack.append((indent, kind))
            continue
        launches[kind] += 1
        captured += in_buffer
        outside += not in_buffer
    total = sum(launches.values())
    return {
        "launches": total,
        "launches_per_layer": round(total / layers, 1) if layers else None,
        "launch_kinds": dict(launches.most_common()),
        "command_buffers": buffers,
        "captured_launches": captured,
        "host_launches": buffers + outside,
        "graph_captured": total > 0 and outside == 0,
    }


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


# Mosaic GPU kernels refuse, when they run, any input or output buffer that is not 256-byte aligned (jaxlib's
# custom_call.cc: "Input buffer 3 is not 256-byte aligned"). XLA places its own buffers on such boundaries, but it
# hands a custom call a slice of another buffer as an address inside it (a dynamic-slice fusion), so a slice at an
# unaligned offset compiles and then fails at the first step. Read off the compiled HLO here.
MOSAIC_ALIGN_BYTES = 256
_HLO_OP = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\(.*?\)|\S+) ([\w-]+)\(([^)]*)\)")
_ARRAY = re.compile(r"^([a-z]+\d*)\[([\d,]*)\](?:\{([\d,]*)\})?")
_SLICE_STARTS = re.compile(r"slice=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4}


def _bits(etype: str) -> int:
    if etype in _BITS:
        return _BITS[etype]
    m = re.search(r"(\d+)", etype)
    return int(m.group(1)) if m else 8


def _strides(dims: tuple[int, ...], minor_to_major: tuple[int, ...]) -> list[int]:
    """Element strides of each dimension of an array laid out `minor_to_major` (default: row-major)."""
    order = minor_to_major or tuple(reversed(range(len(dims))))
    strides, step = [0] * len(dims), 1
    for d in order:
        strides[d] = step
        step *= dims[d]
    return strides


def misaligned_kernel_operands(hlo: str) -> list[str]:
    """Operands of the Mosaic GPU custom calls of a compiled HLO module that are slices of a larger buffer at an
    offset that is not a multiple of MOSAIC_ALIGN_BYTES (static slices), or may not be (dynamic slices along a
    dimension whose stride is not); each as "<kernel> operand <i>: <why>"."""
    out: list[str] = []
    ops: dict[str, tuple[str, str, list[str], str]] = {}  # the current computation's: name -> (type, op, args, line)
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a computation starts: names are its own
            ops = {}
            continue
        m = _HLO_OP.match(line)
        if m is None:
            continue
        name, typ, op, args = m.groups()
        arg_names = [a.split("%", 1)[1].strip() for a in args.split(",") if "%" in a]
        ops[name] = (typ, op, arg_names, line[:2000])
        if op != "custom-call" or 'custom_call_target="mosaic_gpu' not in line:
            continue
        op_name = _OP_NAME.search(line)
        path = (op_name.group(1) if op_name else name).split("/")
        kernel = path[-2] if len(path) > 1 else path[-1]  # ".../<kernel name>/mpmd_map"
        for i, arg in enumerate(arg_names):
            while arg in ops and ops[arg][1] == "bitcast":  # a bitcast is the same address
                arg = ops[arg][2][0]
            if arg not in ops or ops[arg][1] not in ("slice", "dynamic-slice"):
                continue
            _, op_kind, src_args, slice_line = ops[arg]
            src = ops.get(src_args[0])
            a = _ARRAY.match(src[0]) if src else None
            if a is None:
                continue
            dims = tuple(int(d) for d in a.group(2).split(",") if d)
            layout = tuple(int(d) for d in (a.group(3) or "").split(",") if d)
            strides, bits = _strides(dims, layout), _bits(a.group(1))
            if op_kind == "slice":
                starts = [
                    int(s.strip(" [").split(":")[0]) for s in _SLICE_STARTS.search(slice_line).group(1).split("],")
                ]
                offset = sum(s * st for s, st in zip(starts, strides, strict=False)) * bits // 8
                if offset % MOSAIC_ALIGN_BYTES:
                    out.append(f"{kernel} operand {i}: a slice of %{src_args[0]} at byte offset {offset}")
            else:
                size = _ARRAY.match(ops[arg][0])
                sliced = tuple(int(d) for d in size.group(2).split(",") if d) if size else dims
                bad = [
                    d for d in range(len(dims)) if sliced[d] != dims[d] and strides[d] * bits // 8 % MOSAIC_ALIGN_BYTES
                ]
                if bad:
                    out.append(f"{kernel} operand {i}: a dynamic slice of %{src_args[0]} along dimension(s) {bad}")
    return out
