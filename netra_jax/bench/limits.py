"""This machine's own limits, and a served model's figures as fractions of them: the read bandwidth of all cores
(XLA's sum over 1 GiB of float32) and the float32 FMA peak (numpy's BLAS, its AVX-512 or AVX2 kernels, on cores
and data it keeps busy), measured in the run that is compared; then, per engine and concurrency of a `netra-jax bench
serve` result, the decode step's bytes and FLOPs over its TPOT against them.

A decode step of C sequences reads every weight once (a separate token-embedding table only in the rows it gathers:
left out) and each sequence's K and V up to its position, and does 2 FLOPs per matmul weight per sequence plus the
attention's 4 per head dimension and key. The position is the prompt plus half the output: the mean over the decode.
At one user the bandwidth fraction is the figure to read (the step streams the weights), at 32 the FMA fraction.

Usage: `python -m netra_jax.bench.limits measure OUT.json` and `python -m netra_jax.bench.limits table --limits
BEFORE.json [AFTER.json] --result R.json LABEL KV_BYTES MODEL.gguf [--result ...]` (a markdown table on stdout;
KV_BYTES: the engine's bytes per K or V entry, MODEL: the file it served). benchmarks/compare_llamacpp.sh runs
both."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelCosts", "fma_peak_gflops", "measure", "model_costs", "read_bandwidth_gbs", "table"]


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of XLA's sum over a float32 array of `nbytes` (every core reading), the best of `repeats`."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(total(a))
        best = min(best, time.perf_counter() - t0)
    del a
    return nbytes / best / 1e9


def fma_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """float32 GFLOP/s of numpy's BLAS on [n, n] @ [n, n] (all cores), the best of `repeats`: what the cores' FMA
    units give a kernel that keeps them fed (OpenBLAS picks its AVX-512 or AVX2 kernels by the CPU)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def measure() -> dict:
    """Both limits, with the time they were taken."""
    return {"read_gbs": read_bandwidth_gbs(), "fma_gflops": fma_peak_gflops(), "time": time.time()}


@dataclass(frozen=True)
class ModelCosts:
    """What a decode step of a model reads and computes, per sequence and position."""

    weight_bytes: int  # read once per step (all tensors but a separate token-embedding table)
    matmul_params: int  # weights of the matmuls (lm_head included), 2 FLOPs each per sequence
    kv_elements_per_token: int  # K and V elements a position holds over all layers
    attention_flops_per_key: int  # q.k and p.v over all layers and query heads, per key

    def step(self, seqs: int, position: float, kv_bytes: int) -> tuple[float, float]:
        """(bytes, FLOPs) of a decode step of `seqs` sequences at `position`, KV entries of `kv_bytes` each."""
        kv = seqs * position * self.kv_elements_per_token * kv_bytes
        flops = seqs * (2.0 * self.matmul_params + position * self.attention_flops_per_key)
        return self.weight_bytes + kv, flops


def model_costs(path: str | Path) -> ModelCosts:
    """The costs of a GGUF file's model (the tensors as stored: a quantized file's bytes are its blocks)."""
    import gguf

    from netra_jax.loader import load_config

    cfg = load_config(str(path))
    tensors = gguf.GGUFReader(str(path)).tensors
    has_output = any(t.name == "output.weight" for t in tensors)
    weights = [t for t in tensors if not (has_output and t.name == "token_embd.weight")]
    matmul = [t for t in weights if len(t.shape) >= 2]
    return ModelCosts(
        weight_bytes=sum(int(t.n_bytes) for t in weights),
        matmul_params=sum(int(t.n_elements) for t in matmul),
        kv_elements_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim,
        attention_flops_per_key=cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim,
    )


def table(limits: list[dict], results: list[tuple[dict, str, int, ModelCosts]]) -> str:
    """A markdown table: per result (a bench serve result, its label, its engine's bytes per KV entry, the costs of
    the model it served) and concurrency, output tok/s, TPOT and the decode step's bytes and its read-bandwidth and
    FMA fractions against the mean of `limits`."""
    bw = sum(x["read_gbs"] for x in limits) / len(limits)
    peak = sum(x["fma_gflops"] for x in limits) / len(limits)
    bws = ", ".join(f"{x['read_gbs']:.1f}" for x in limits)
    peaks = ", ".join(f"{x['fma_gflops']:.0f}" for x in limits)
    lines = [
        f"Limits measured in this run (before and after the engines): read bandwidth {bw:.1f} GB/s ({bws}), float32"
        f" FMA peak {peak:.0f} GFLOP/s ({peaks}).",
        "",
        "| engine | users | output tok/s | median TPOT ms | step MB | read BW fraction | FMA fraction |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for doc, label, kv_bytes, costs in results:
        cfg = doc.get("config", {})
        position = cfg.get("input_len", 0) + cfg.get("output_len", 0) / 2
        for run in doc.get("runs", []):
            tpot = run.get("median_tpot_ms")
            if not tpot:
                continue
            users = run["max_concurrency"]
            nbytes, flops = costs.step(users, position, kv_bytes)
            seconds = tpot / 1e3
            lines.append(
                f"| {label} | {users} | {run['output_throughput']:.1f} | {tpot:.2f} | {nbytes / 1e6:.0f} |"
                f" {nbytes / seconds / 1e9 / bw:.2f} | {flops / seconds / 1e9 / peak:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure the limits into a JSON file")
    m.add_argument("out")
    t = sub.add_parser("table", help="print the fractions table")
    t.add_argument("--limits", nargs="+", required=True, help="JSON files of `measure`")
    t.add_argument("--result", nargs=4, action="append", default=[], metavar=("JSON", "LABEL", "KV_BYTES", "MODEL"))
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        limits = measure()
        Path(a.out).write_text(json.dumps(limits))
        print(f"read bandwidth {limits['read_gbs']:.1f} GB/s, float32 FMA peak {limits['fma_gflops']:.0f} GFLOP/s")
        return 0
    limits = [json.loads(Path(p).read_text()) for p in a.limits]
    costs = {model: model_costs(model) for *_, model in a.result}
    results = [(json.loads(Path(f).read_text()), label, int(kv), costs[model]) for f, label, kv, model in a.result]
    print(table(limits, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
