"""Where a CPU decode step's milliseconds go: the forward of D decode tokens at a context length, with its layers in
XLA (the jnp layer, matmul backend "xla") and as decode-layer calls ("cpu_rows"), and the parts of the latter jitted
alone on the same weights: the layer calls, the lm_head, the weights streamed through the rows kernel with nothing
else (the layers' matmul floor), against this machine's read bandwidth measured in the same run.

Usage: `.venv/bin/python -m benchmarks.step_profile layers [--model GGUF_OR_DIR] [--rows 1,32] [--context 200]
[--repeats 9] [--out STEM]` (default model: the float32 copy of the embedded SmolLM2, `python -m
netra_jax.bench.gguf_f32 --default`). Times are the minimum over interleaved repeats. Writes
benchmarks/results/<date>-decode_step_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from benchmarks.step_profile import common


def _timer(fn, *args):
    """A timer of `fn(*args)` (wall seconds until ready), called twice first so that it is compiled and warm."""

    def once() -> float:
        return common.time_call(lambda: fn(*args))[0]

    once()
    once()
    return once


def profile(cfg, params, rows: int, context: int, repeats: int) -> dict:
    """Milliseconds of each part of a decode step of `rows` tokens at position `context` (see the module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from netra_jax import paged
    from netra_jax.models.norms import rms_norm
    from netra_jax.models.rope import rope_tables
    from netra_jax.models.transformer import KVCache, forward, init_kv_cache
    from netra_jax.ops import cpu_decode_layer, cpu_matmul

    pages_per = -(-(context + 1) // 16)
    kv = init_kv_cache(cfg, pages_per * rows, 16)
    tables = [list(range(s * pages_per, (s + 1) * pages_per)) for s in range(rows)]
    batch = paged.build_batch([context + 1] * rows, [1] * rows, tables, page_size=16, num_pages=pages_per * rows)
    ids = jnp.ones((rows,), jnp.int32)
    # the cache is donated and carried from call to call, as the engine does (else XLA copies it around the kernels);
    # the weights are arguments (captured as constants, XLA would bake them into the program)
    fwd = jax.jit(forward, static_argnames=("cfg", "backend", "matmul_backend"), donate_argnums=(4,))
    md = batch.metadata
    state = {"kv": kv}

    def run_forward(mb):
        logits, state["kv"] = fwd(
            params,
            cfg,
            ids,
            batch.positions,
            state["kv"],
            md,
            batch.last_token_indices,
            backend="cpu",
            matmul_backend=mb,
        )
        return logits

    lay = paged_layout(md, rows)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def layers(params, x, kv):
        cos, sin = rope_tables(batch.positions, cfg.layer_rope(0), cfg.rotary_dim)
        ks, vs = [], []
        for i, lp in enumerate(params["layers"]):
            x, k, v = cpu_decode_layer.decode_layer(
                x, lp, kv.k[i], kv.v[i], cos, sin, md.slot_mapping, *lay, cfg=cfg, i=i
            )
            ks.append(k)
            vs.append(v)
        return x, KVCache(k=ks, v=vs)

    def run_layers(x):
        out, state["kv"] = layers(params, x, state["kv"])
        return out

    @jax.jit
    def lm_head(params, x):
        return cpu_matmul.rows_matmul(rms_norm(x, params["final_norm"], cfg.rms_norm_eps), params["lm_head"])

    @jax.jit
    def stream(params, x):
        side = jnp.zeros((), jnp.float32)
        for lp in params["layers"]:
            for w in (lp["wqkv"], lp["wo"], lp["w_gate_up"], lp["w_down"]):
                w2 = w.reshape(w.shape[0], -1)
                xi = jnp.broadcast_to(x[:, :1], (rows, w2.shape[0]))
                side += cpu_matmul.rows_matmul(xi, w2)[:, 0].sum()
        return side

    x = jnp.full((rows, cfg.hidden_size), 0.01, jnp.float32)
    parts = {
        "forward_xla_layers": _timer(run_forward, "xla"),
        "forward_decode_layers": _timer(run_forward, "cpu_rows"),
        "decode_layer_calls": _timer(run_layers, x),
        "lm_head": _timer(lm_head, params, x),
        "weights_stream": _timer(stream, params, x),
    }
    times = {k: [] for k in parts}
    for _ in range(repeats):
        for k, once in parts.items():
            times[k].append(once())
    ms = {k: 1e3 * min(v) for k, v in times.items()}
    layer_bytes = sum(a.nbytes for lp in params["layers"] for a in jax.tree.leaves(lp))
    head_bytes = int(np.prod(params["lm_head"].shape)) * params["lm_head"].dtype.itemsize
    ms["rest"] = ms["forward_decode_layers"] - ms["decode_layer_calls"] - ms["lm_head"]
    return {
        "rows": rows,
        "context": context,
        "ms": ms,
        "layer_MB": layer_bytes / 1e6,
        "lm_head_MB": head_bytes / 1e6,
        "layers_GBs": layer_bytes / ms["decode_layer_calls"] / 1e6,
        "stream_GBs": layer_bytes / ms["weights_stream"] / 1e6,
        "lm_head_GBs": head_bytes / ms["lm_head"] / 1e6,
    }


def paged_layout(md, num_tokens: int):
    """(q_pos, valid, rows) of each token: what the decode layer reads besides the slot mapping."""
    from netra_jax.ops.attention import with_token_layout

    lay = with_token_layout(md, num_tokens).layout
    return lay.q_pos, lay.valid, lay.rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(
        p,
        repeats=9,
        model_help="a float32-loadable checkpoint (default: SmolLM2 F32 GGUF)",
        out_help="results stem (default benchmarks/results/<date>-decode_step_profile)",
    )
    p.add_argument("--rows", default="1,32", help="decode tokens per step, comma-separated")
    p.add_argument("--context", type=int, default=200)


def run(a: argparse.Namespace) -> int:
    from netra_jax.bench import limits
    from netra_jax.bench.gguf_f32 import default_f32
    from netra_jax.bench.machine import describe
    from netra_jax.loader import load_model
    from netra_jax.models.transformer import fuse_qkv

    record = common.Run("decode_step_profile")
    model = a.model or str(default_f32())
    cfg, params = load_model(model, "float32", cache=False)
    params = fuse_qkv(params)
    bw = limits.read_bandwidth_gbs()
    rows = [profile(cfg, params, int(r), a.context, a.repeats) for r in a.rows.split(",")]
    doc = record.record(model=model, read_GBs=bw, rows=rows)
    stem = Path(a.out) if a.out else common.RESULTS / f"{doc['date']}-decode_step_profile"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# A CPU decode step, part by part ({doc['date']})",
        "",
        f"- Model: `{Path(model).name}` float32 (q/k/v joined, the engine's CPU layout); context {a.context}.",
        f"- Machine: {describe(doc['machine'])}; read bandwidth {bw:.1f} GB/s measured in this run.",
        "- `python -m benchmarks.step_profile layers`: minimum of interleaved repeats, each part jitted alone.",
        "",
        "| rows | forward, XLA layers | forward, decode layers | layer calls (GB/s) | lm_head (GB/s) | rest |"
        " weights through the rows kernel alone (GB/s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m = r["ms"]
        lines.append(
            f"| {r['rows']} | {m['forward_xla_layers']:.1f} | {m['forward_decode_layers']:.1f} | "
            f"{m['decode_layer_calls']:.1f} ({r['layers_GBs']:.1f}) | {m['lm_head']:.1f} ({r['lm_head_GBs']:.1f}) | "
            f"{m['rest']:.1f} | {m['weights_stream']:.1f} ({r['stream_GBs']:.1f}) |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem.with_suffix('.json')} and .md")
    return 0
