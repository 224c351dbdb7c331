"""Few-row float32 matmul on CPU: the kernel in `cpu_matmul.cc`, compiled on first use for this machine's CPU and
called through XLA's FFI, for the decode-sized matmuls XLA's CPU dot runs slowly; `jnp.dot` is its reference.

A decode step multiplies one row per running sequence by every weight matrix. On CPU that is a stream of the weights
through the cores, and XLA's dot streams them at about half speed from 8 rows on (11.5 against 20.1 GB/s for
SmolLM2's [576, 1536] at 8 rows on a 2-core Xeon; see the .cc file for the kernel's layout). The kernel takes
x [M, K] @ w [K, N] in float32 for ROWS_MIN <= M <= ROWS_MAX; other shapes and dtypes run `jnp.dot`.

Build: the host's C++ compiler (`$CXX`, else g++ or c++) with `-O3 -march=native` against jax's FFI headers, once per
source, compiler and CPU, into `<netra_jax cache>/kernels/`. Without a compiler, or when the build fails, `available()`
is False with the reason logged once, and the engine runs XLA's dot."""

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
from pathlib import Path

import jax
import jax.numpy as jnp

from netra_jax.assets import cache_dir

__all__ = ["ROWS_MAX", "ROWS_MIN", "TARGET", "available", "build", "rows_matmul", "takes", "unavailable_reason"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "netra_small_matmul_f32"
# One row: XLA's dot streams the weights faster (27 against 22 GB/s). Past 32 rows the kernel's row tiles make it
# compute-bound and XLA's blocked dot catches up.
ROWS_MIN = 2
ROWS_MAX = 32
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


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
    """The kernel's shared library, compiled now unless a build for this source, compiler and CPU is cached.
    Raises RuntimeError (with the compiler's output) when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cxx, version, " ".join(_FLAGS), _cpu_signature(), jax.__version__]).encode()
    ).hexdigest()[:20]
    out_dir = cache_dir() / "kernels"
    out = out_dir / f"cpu_matmul-{key}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: processes building at once each leave a whole library
    return out


@functools.cache
def _load() -> str | None:
    """Build, load and register the kernel once per process; None when ready, else why it is not."""
    try:
        lib = ctypes.CDLL(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.NetraSmallMatmulF32), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the CPU few-row matmul kernel is unavailable, XLA's dot runs instead: %s", e)
        return str(e)
    return None


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether `rows_matmul` runs the kernel for these operands (else `jnp.dot`)."""
    return (
        x.ndim == 2
        and w.ndim == 2
        and ROWS_MIN <= x.shape[0] <= ROWS_MAX
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
    )


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@jax.custom_jvp
def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _kernel(x, w)


@_rows_matmul.defjvp
def _rows_matmul_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _kernel(x, w), jnp.dot(dx, w) + jnp.dot(x, dw)  # linear in the tangents: reverse mode transposes it


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] on the CPU kernel when it `takes` them and is `available`, else `jnp.dot`. Differentiable
    (forward and reverse: the derivative is jnp's). Lowers for CPU only."""
    if takes(x, w) and available():
        return _rows_matmul(x, w)
    return jnp.dot(x, w)
