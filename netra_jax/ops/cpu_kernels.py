"""The C++ CPU kernels (`cpu_matmul.cc`, `cpu_attention.cc`, `cpu_ggml_matmul.cc`, `cpu_decode_layer.cc`, sharing
`cpu_pool.h` and the matmul's and attention's cores in `cpu_matmul.h` and `cpu_attention.h`; the GGML-block matmul's
formats and kernels in `ggml_blocks.h`, `ggml_matmul.h`, `ggml_matmul_q8.h` and `ggml_interleaved.h`): compiled
on first use into one shared library for this machine's CPU and registered as XLA FFI targets; `available()` says
whether they are ready.

Build: the host's C++ compiler (`$CXX`, else g++, c++ or clang++) with `-O3 -march=native` against jax's FFI
headers, once per source, compiler and CPU, into `<netra_jax cache>/kernels/`. Without a compiler, or when the build
fails, `available()` is False with the reason logged once, and the engine runs its jnp / XLA paths instead."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from netra_jax.assets import cache_dir
from netra_jax.ops import ggml_blocks

__all__ = [
    "SOURCES",
    "TARGETS",
    "available",
    "build",
    "interleave",
    "interleaved_rows",
    "register_builds",
    "unavailable_reason",
]

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (
    HERE / "cpu_matmul.cc",
    HERE / "cpu_attention.cc",
    HERE / "cpu_ggml_matmul.cc",
    HERE / "cpu_decode_layer.cc",
)
HEADERS = (
    HERE / "cpu_pool.h",
    HERE / "cpu_matmul.h",
    HERE / "cpu_attention.h",
    HERE / "ggml_blocks.h",
    HERE / "ggml_matmul.h",
    HERE / "ggml_matmul_q8.h",
    HERE / "ggml_interleaved.h",
)
# FFI target name -> the handler symbol the library exports
TARGETS = {
    "netra_small_matmul_f32": "NetraSmallMatmulF32",
    "netra_small_matmul_i8": "NetraSmallMatmulI8",
    "netra_small_matmul_e4m3": "NetraSmallMatmulE4M3",
    "netra_small_matmul_bf16": "NetraSmallMatmulBF16",
    "netra_token_attention_f32": "NetraTokenAttentionF32",
    "netra_ggml_matmul_f32": "NetraGgmlMatmulF32",
    "netra_decode_layer_f32": "NetraDecodeLayerF32",
}
# reassociated float sums let the compiler vectorize the attention's dot products (the matmul's vectors are explicit)
_FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-w",
)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _required_compiler() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    return cxx


def _compile(cxx: str, flags: Sequence[str], sources: Sequence[Path], out: str | Path) -> None:
    """Compile `sources` into the shared library `out` with `flags` against jax's FFI headers; RuntimeError with the
    compiler's output when it fails."""
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, sources), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by machines must not hand
    one CPU's build to another)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build() -> Path:
    """The kernels' shared library, compiled now unless a build for these sources, compiler and CPU is cached.
    Raises RuntimeError (with the compiler's output) when it cannot be built."""
    cxx = _required_compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    parts = [
        *(s.read_text() for s in (*SOURCES, *HEADERS)),
        cxx,
        version,
        " ".join(_FLAGS),
        _cpu_signature(),
        jax.__version__,
    ]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    out_dir = cache_dir() / "kernels"
    out = out_dir / f"netra_cpu_kernels-{key}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        _compile(cxx, _FLAGS, SOURCES, tmp)
    except RuntimeError:
        os.unlink(tmp)
        raise
    os.replace(tmp, out)  # atomic: processes building at once each leave a whole library
    return out


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """Build, load and register the kernels once per process: (the library, None) when ready, else (None, why)."""
    try:
        lib = ctypes.CDLL(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        log.warning("the C++ CPU kernels are unavailable, the jnp / XLA paths run instead: %s", e)
        return None, str(e)
    return lib, None


def _load() -> str | None:
    return _library()[1]


def available() -> bool:
    """Whether the kernels are built and registered (building them on the first call)."""
    return _load() is None


@functools.cache
def interleaved_rows() -> int:
    """Rows per group of the interleaved GGML layout (`ggml_blocks.interleave_rows`) this machine's build reads with
    int8 activations (16 with AVX-512 VNNI), 0 when it reads none or the kernels are unavailable."""
    lib = _library()[0]
    return 0 if lib is None else int(lib.NetraGgmlInterleavedRows())


def interleave(rows: np.ndarray, qtype: str) -> np.ndarray:
    """GGML rows [..., N, row_bytes] (uint8, N a multiple of `interleaved_rows()`) of Q4_K or Q6_K in their
    interleaved layout (`ggml_blocks.interleave_rows` is the reference), by the kernels' library at memory speed.
    RuntimeError when the kernels are unavailable, ValueError for what the layout does not take."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the C++ CPU kernels are unavailable: {unavailable_reason()}")
    layout = ggml_blocks.interleaved_layout(qtype)
    src = np.ascontiguousarray(rows, dtype=np.uint8)
    if layout is None or src.ndim < 2:
        raise ValueError(f"interleave takes Q4_K or Q6_K rows [..., N, row_bytes], got {qtype} {src.shape}")
    group = ggml_blocks.FORMATS[layout].interleaved
    if src.shape[-2] % group:  # (the library sees the rows flattened: a group must not straddle the leading axes)
        raise ValueError(f"{qtype} rows {src.shape} are not whole groups of {group} rows along N")
    out = np.empty_like(src)
    n = src.size // src.shape[-1]
    fn = lib.NetraGgmlInterleave
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    if fn(src.ctypes.data, out.ctypes.data, n, src.shape[-1], ggml_blocks.FORMATS[qtype].ggml_type) != 0:
        raise ValueError(f"{qtype} rows {src.shape} are not whole groups of {group} rows of whole blocks")
    return out


def unavailable_reason() -> str | None:
    return _load()


def register_builds(
    source: Path, symbol: str, target: str, builds: Mapping[str, Sequence[str]], out_dir: Path
) -> dict[str, str]:
    """Compile one kernel source once per entry of `builds` (name -> instruction-set flags, in place of
    -march=native), in parallel, into `out_dir`; register each build's handler `symbol` as FFI target
    `<target>_<name>` and return name -> target. Tests use it to run the code paths other CPUs take.
    Raises RuntimeError (with the compiler's output) when a build fails or there is no compiler."""
    cxx = _required_compiler()
    flags = [f for f in _FLAGS if not f.startswith("-march")]

    def one(name: str) -> str:
        lib = out_dir / f"{Path(source).stem}-{name}.so"
        _compile(cxx, [*flags, *builds[name]], [source], lib)
        handler = getattr(ctypes.CDLL(str(lib)), symbol)
        jax.ffi.register_ffi_target(f"{target}_{name}", jax.ffi.pycapsule(handler), platform="cpu")
        return f"{target}_{name}"

    with ThreadPoolExecutor(len(builds)) as pool:
        return dict(zip(builds, pool.map(one, builds), strict=True))
