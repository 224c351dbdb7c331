"""The GGML-block matmul kernel (netra_jax/ops/cpu_ggml_matmul.cc) per type on Llama-1B-like shapes, against XLA's
float32 dot of the de-quantized weight and the float32 few-row kernel: ms per call and GB/s of weight bytes read
(the quantized bytes for the kernel, 4 bytes a weight for the float dots); Q4_K_X16 and Q6_K_X16 are those types'
rows interleaved by 16 (`ggml_blocks.interleave_rows`, int8 activations only). The case "int4_g128" is a 4-bit weight
with zero points in groups of 128 (AWQ / GPTQ / compressed-tensors W4A16, `PackedIntWeight`): its jnp reference
(XLA's dot over the de-quantized weight, every step) against the Q4_1 blocks the CPU backends re-lay it as at load
(`quant.repack.for_cpu`), GB/s of the bytes each reads; "int8_channel" and "fp8_channel" are per-output-channel int8
and e4m3 weights (`--quantization int8 / fp8`, FP8 checkpoints), their reference against the few-row kernel.

Each call reads the next of a ring of weight copies (together --ring-mib, beyond the last-level cache), so the
weights come from memory as in a decode step. Random blocks with sane fp16 scales (the speed does not depend on
the values). Time per call: the fastest over --passes walks of the ring (the machine is shared: the minimum is the
least disturbed call; the median is recorded too). The machine's read bandwidth (XLA's sum over a 1 GiB float32
array, best of 5) is recorded next to it, the roofline of the GB/s column.

Writes benchmarks/results/<date>-ggml_matmul.json (or --out).

Usage: .venv/bin/python -m benchmarks.ggml_matmul [--types Q4_0,Q4_K,Q4_K_X16,int4_g128] [--rows 1,8,32]
       [--ring-mib 1024] [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.bench.limits import read_bandwidth_gbs
from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result
from netra_jax.ops import cpu_ggml_matmul, cpu_kernels, cpu_matmul
from netra_jax.ops.ggml_blocks import FORMATS
from netra_jax.quant import PackedIntWeight, QuantizedWeight, matmul
from netra_jax.quant.repack import ggml_from_packed, pack_along_k

RESULTS = Path(__file__).resolve().parent / "results"

SHAPES = [(2048, 8192), (8192, 2048)]  # (K, N): a Llama-1B FFN's gate / up, and its down
GROUPED = "int4_g128"  # a W4A16 weight with zero points, group 128
CHANNEL = {"int8_channel": jnp.int8, "fp8_channel": jnp.float8_e4m3fn}  # per-output-channel weights


def random_blocks(rng, qtype: str, copies: int, n: int, k: int) -> np.ndarray:
    """[copies, n, row_bytes] uint8 random blocks, their fp16 scales (and mins) set in [1e-3, 1e-2]."""
    qk, block_bytes = FORMATS[qtype].qk, FORMATS[qtype].block_bytes
    w = rng.integers(0, 256, (copies, n, k // qk, block_bytes), dtype=np.uint8)
    fields = [208] if qtype == "Q6_K" else [0] if qtype in ("Q4_0", "Q5_0", "Q8_0") else [0, 2]
    for at in fields:
        w[..., at : at + 2] = np.array([rng.uniform(1e-3, 1e-2)], np.float16).view(np.uint8)
    return w.reshape(copies, n, -1)


def random_grouped(rng, copies: int, n: int, k: int, group: int = 128) -> list[PackedIntWeight]:
    """`copies` random 4-bit weights [k, n] with zero points and fp16 scales in [1e-3, 1e-2] per group of rows."""
    out = []
    for _ in range(copies):
        q = jnp.asarray(rng.integers(0, 16, (k, n), dtype=np.int32))
        zero = rng.integers(0, 16, (k // group, n), dtype=np.int32)
        scale = rng.uniform(1e-3, 1e-2, (k // group, n)).astype(np.float16)
        out.append(PackedIntWeight(pack_along_k(q, 4), scale, zero, None, bits=4, group=group, shape=(k, n)))
    return out


def grouped_variants(rng, copies: int, n: int, k: int) -> dict:
    """For the GROUPED case: x kind -> (jitted fn(x, w), its ring, the bytes of one weight it reads)."""
    packed = random_grouped(rng, copies, n, k)
    w0 = packed[0]
    packed_bytes = w0.packed.nbytes + w0.scale.nbytes + w0.zero.nbytes
    relaid = [ggml_from_packed(w) for w in packed]  # Q4_1 blocks
    q4_1_bytes = relaid[0].data.nbytes
    return {
        "float32, reference": (jax.jit(lambda x, w: matmul(x, w, backend="xla")), packed, packed_bytes),
        "float32, Q4_1": (jax.jit(lambda x, w: matmul(x, w, backend="cpu_rows")), relaid, q4_1_bytes),
        "int8, Q4_1": (jax.jit(lambda x, w: matmul(x, w, backend="cpu_rows_q8")), relaid, q4_1_bytes),
    }


def channel_variants(rng, copies: int, n: int, k: int, dtype) -> dict:
    """For a CHANNEL case: x kind -> (jitted fn(x, w), its ring, the bytes of one weight it reads)."""
    ring = []
    for _ in range(copies):
        q = rng.integers(-100, 100, (k, n), dtype=np.int8) if dtype == jnp.int8 else rng.integers(0, 126, (k, n))
        q = jnp.asarray(q.astype(np.int8) if dtype == jnp.int8 else q.astype(np.uint8).view(jnp.float8_e4m3fn))
        ring.append(QuantizedWeight(q=q, scale=jnp.asarray(rng.uniform(1e-3, 1e-2, n).astype(np.float32))))
    nbytes = k * n + n * 4
    return {
        "float32, reference": (jax.jit(lambda x, w: matmul(x, w, backend="xla")), ring, nbytes),
        "float32, kernel": (jax.jit(lambda x, w: matmul(x, w, backend="cpu_rows")), ring, nbytes),
    }


def time_ring(fn, x, ring, passes: int) -> tuple[float, float]:
    """(Fastest, median) seconds per call of fn(x, w) over `passes` walks of the ring of weights."""
    jax.block_until_ready(fn(x, ring[0]))  # compile
    times = []
    for _ in range(passes):
        for w in ring:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, w))
            times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    interleaved = [t for t, f in FORMATS.items() if f.interleaved] if cpu_kernels.interleaved_rows() else []
    ap.add_argument("--types", default=",".join((*cpu_ggml_matmul.TYPES, *interleaved, GROUPED, *CHANNEL)))
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--ring-mib", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default=None, help="result JSON path (default: results/<date>-ggml_matmul.json)")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    types = args.types.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, ring of {args.ring_mib} MiB of weights per case")
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s (XLA sum over 1 GiB, all cores)")
    print(f"{'K x N':>11} {'weights x':>28} {'M':>3} {'ms':>8} {'GB/s':>6}   (GB/s: weight bytes read per second)")
    cases = []
    for k, n in SHAPES:
        for name in ("XLA f32 dot", "f32 kernel", *types):
            if name == GROUPED or name in CHANNEL:
                if name == GROUPED:
                    copies = max(2, args.ring_mib * 2**20 // (n * k * 5 // 8))  # about 5 bits a weight
                    grouped = grouped_variants(rng, copies, n, k)
                else:
                    grouped = channel_variants(rng, max(2, args.ring_mib * 2**20 // (n * k)), n, k, CHANNEL[name])
                variants = {kind: fn for kind, (fn, _, _) in grouped.items()}
            elif name in FORMATS:
                qk, block_bytes = FORMATS[name].qk, FORMATS[name].block_bytes
                nbytes = n * k // qk * block_bytes
                copies = max(2, args.ring_mib * 2**20 // nbytes)
                base = FORMATS[name].base or name  # an interleaved layout: its GGUF type's blocks, re-laid
                blocks = random_blocks(rng, base, copies, n, k)
                ring = [jnp.asarray(w) for w in (blocks if base == name else cpu_kernels.interleave(blocks, base))]
                # activations: float32 as they are, or quantized to int8 blocks in the kernel
                paths = {"float32": False} if name in cpu_ggml_matmul.TYPES else {}
                if name in cpu_ggml_matmul.INT8_TYPES:
                    paths["int8"] = True
                variants = {
                    x_kind: jax.jit(lambda x, w, q=name, i=int8_x: cpu_ggml_matmul.blocks_matmul(x, w, q, int8_x=i))
                    for x_kind, int8_x in paths.items()
                }
            else:
                nbytes = n * k * 4
                copies = max(2, args.ring_mib * 2**20 // nbytes)
                ring = [jnp.asarray(rng.standard_normal((k, n), dtype=np.float32)) for _ in range(copies)]
                variants = {"float32": jax.jit(jnp.dot if name == "XLA f32 dot" else cpu_matmul.rows_matmul)}
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                if name == "f32 kernel" and not cpu_matmul.takes(x, ring[0]):
                    continue
                for x_kind, fn in variants.items():
                    if name == GROUPED or name in CHANNEL:
                        _, ring, nbytes = grouped[x_kind]
                    s, median = time_ring(fn, x, ring, args.passes)
                    label = f"{name} x {x_kind}"
                    print(f"{k:>5}x{n:<5} {label:>28} {m:>3} {s * 1e3:>8.3f} {nbytes / s / 1e9:>6.1f}", flush=True)
                    cases.append(
                        {
                            "K": k,
                            "N": n,
                            "weights": name,
                            "x": x_kind,
                            "rows": m,
                            "ms": s * 1e3,
                            "median_ms": median * 1e3,
                            "weight_gbs": nbytes / s / 1e9,
                        }
                    )
            ring = grouped = None
    doc = {
        "benchmark": "ggml_matmul",
        "machine": machine_info(),
        "ring_mib": args.ring_mib,
        "passes": args.passes,
        "read_bandwidth_gbs": bandwidth,
        "load_average_after": os.getloadavg(),  # other processes on a shared machine slow every case
        "cases": cases,
    }
    write_result(doc, "ggml_matmul", RESULTS, args.out)


if __name__ == "__main__":
    main()
