"""The roofline of a decode step: this machine's peaks (float32 matmul through numpy's BLAS and XLA's `jnp.dot`, copy
bandwidth), the step's FLOPs and bytes, and where an engine's step spends its time (step split, forward parts).

Usage: `.venv/bin/python -m benchmarks.step_profile roofline [--model PATH] [--batches 1,32] [--context 200]
[--repeats 3] [--quick] [--out FILE]`: the peaks, then per batch the step's FLOPs and bytes, the time they take at
the peaks (compute and bandwidth floors), the parts of the engine's decode step jitted alone (`component_times`)
and each distinct matmul of the step alone. Writes benchmarks/results/<date>-roofline.json and prints a line per
batch. The offline throughput benchmark takes its peaks, costs and step profile from here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.step_profile import common


def numpy_sgemm_gflops(n: int = 2048, repeats: int = 7) -> dict:
    """float32 [n, n] @ [n, n] through numpy's BLAS; GFLOP/s from the median and the best call."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    med, times = common.median_time(lambda: np.matmul(a, b, out=c), repeats)
    flops = 2.0 * n**3
    return {"n": n, "median_s": med, "gflops": flops / med / 1e9, "best_gflops": flops / min(times) / 1e9}


def xla_dot_gflops(m: int = 2048, k: int = 2048, n: int = 2048, repeats: int = 7) -> dict:
    """float32 [m, k] @ [k, n] as a jitted `jnp.dot` on the default JAX device."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    med, times = common.median_time(lambda: f(a, b).block_until_ready(), repeats)
    flops = 2.0 * m * k * n
    return {"shape": [m, k, n], "median_s": med, "gflops": flops / med / 1e9, "best_gflops": flops / min(times) / 1e9}


def copy_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Large float32 `np.copyto`: GB/s counting the bytes read plus the bytes written (STREAM 'copy' convention)."""
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    med, times = common.median_time(lambda: np.copyto(dst, src), repeats)
    moved = 2.0 * n * 4
    return {"bytes": n * 4, "median_s": med, "gbs": moved / med / 1e9, "best_gbs": moved / min(times) / 1e9}


def measure_peaks(quick: bool = False) -> dict:
    """Matmul peak (the higher of numpy BLAS and XLA, in GFLOP/s) and copy bandwidth, with the raw readings."""
    n = 512 if quick else 2048
    np_mm = numpy_sgemm_gflops(n, repeats=3 if quick else 7)
    xla_mm = xla_dot_gflops(n, n, n, repeats=3 if quick else 7)
    bw = copy_bandwidth_gbs((32 << 20) if quick else (512 << 20), repeats=3 if quick else 5)
    return {
        "numpy_sgemm": np_mm,
        "xla_dot": xla_mm,
        "matmul_peak_gflops": max(np_mm["gflops"], xla_mm["gflops"]),
        "matmul_peak_source": "numpy" if np_mm["gflops"] >= xla_mm["gflops"] else "xla",
        "copy_bandwidth": bw,
        "bandwidth_gbs": bw["gbs"],
    }


# ---------------------------------------------------------------------------------------------------- model costs
def matmul_params(cfg) -> int:
    """Weights that take part in a matmul for every token: all layers' projections plus the lm-head (the
    embedding lookup is a gather, so an untied embedding is left out)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * i
    return cfg.num_layers * per_layer + h * cfg.vocab_size


def weight_bytes(cfg, itemsize: int = 4) -> int:
    """Bytes of weights read by one decode step: the matmul weights (the embedding rows gathered are negligible)."""
    return matmul_params(cfg) * itemsize


def attention_flops_per_token(cfg, context: float) -> float:
    """q.k and p.v over `context` keys in every layer (sliding-window layers capped at their window)."""
    total = 0.0
    for i in range(cfg.num_layers):
        w = cfg.layer_window(i) if cfg.layer_types else None
        ctx = min(context, w) if w else context
        total += 4.0 * cfg.num_heads * cfg.head_dim * ctx
    return total


def flops_per_token(cfg, context: float) -> float:
    """FLOPs of one token of a decode step at a mean context length: 2 * matmul params + attention."""
    return 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, context)


def kv_bytes_per_token(cfg, context: float, itemsize: int = 4) -> float:
    """Bytes of K and V read by one decoding sequence at a mean context length."""
    return 2.0 * cfg.num_layers * cfg.kv_size * context * itemsize


def decode_step_costs(cfg, batch: int, context: float, itemsize: int = 4, weights: int | None = None) -> dict:
    """FLOPs and bytes of one decode step of `batch` sequences with a mean context of `context` tokens; weights: the
    bytes of weights a step reads when they are not float `itemsize` ones (a quantized GGUF file: its size)."""
    weights = weight_bytes(cfg, itemsize) if weights is None else weights
    return {
        "batch": batch,
        "mean_context": context,
        "matmul_params": matmul_params(cfg),
        "flops_per_token": flops_per_token(cfg, context),
        "flops_per_step": batch * flops_per_token(cfg, context),
        "weight_bytes": weights,
        "kv_bytes_per_step": batch * kv_bytes_per_token(cfg, context, itemsize),
        "bytes_per_step": weights + batch * kv_bytes_per_token(cfg, context, itemsize),
    }


def quantized_file_bytes(model: str | None) -> int | None:
    """The size of a GGUF file that holds quantized blocks (the bytes its decode step reads, as llama.cpp's roofline
    counts them), else None."""
    if not model or not str(model).endswith(".gguf"):
        return None
    from netra_jax.loader.gguf_loader import GGUFFile

    tensors = GGUFFile(model).tensors.values()
    return Path(model).stat().st_size if any(t.qtype.name not in ("F32", "F16", "BF16") for t in tensors) else None


# ---------------------------------------------------------------------------------------------------- where time goes
def component_times(llm, batch: int, context: int, repeats: int = 3) -> dict:
    """Median ms of the parts of one decode step of `batch` sequences at `context` tokens, each jitted alone on the
    engine's real parameters: all layers' projections chained (no attention) on the engine's matmul backend, the
    lm-head, and the attention backend over every layer's paged cache. The rest of a forward (norms, RoPE, KV write,
    embedding) is the gap."""
    import jax
    import jax.numpy as jnp

    from netra_jax.ops.attention import AttentionMetadata, attention
    from netra_jax.quant import matmul

    runner, cfg = llm.engine.runner, llm.model_config
    params = runner.params
    dt = next(x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))  # not GGUF's bytes
    x0 = jnp.full((batch, cfg.hidden_size), 0.01, dt)

    mb = runner.matmul_backend  # the engine's kernels: a GGUF file's blocks go through its GGML kernel

    def mm(x, w, spec=None):
        return matmul(x, w, spec, backend=mb)

    @jax.jit
    def matmuls(params, x):
        side = jnp.zeros((), jnp.float32)
        for lp in params["layers"]:
            if "wqkv" in lp:  # the engine's CPU layout: q, k and v in one matmul
                qkv = mm(x, lp["wqkv"])
                q = qkv[:, : cfg.q_size]
                side += qkv[:, cfg.q_size :].sum()
            else:
                q = mm(x, lp["wq"])
                side += mm(x, lp["wk"]).sum() + mm(x, lp["wv"]).sum()
            gu = mm(x, lp["w_gate_up"], "th,hki->tki")
            x = x + 1e-3 * (mm(q, lp["wo"]) + mm(gu[:, 0] * gu[:, 1], lp["w_down"]))
        return x, side

    @jax.jit
    def lm_head(params, x):
        return matmul(x, params["lm_head"], preferred_element_type=jnp.float32, backend=mb)

    k_pages = runner.kv.k[0]
    num_pages, page = k_pages.shape[0], k_pages.shape[1]
    per_seq = -(-context // page)
    width = max(per_seq, runner.max_pages)
    bt = (np.arange(batch * per_seq, dtype=np.int32) % num_pages).reshape(batch, per_seq)
    md = AttentionMetadata(
        slot_mapping=jnp.full((batch,), num_pages * page, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
        seq_lens=jnp.full((batch,), context, jnp.int32),
        block_tables=jnp.asarray(np.pad(bt, ((0, 0), (0, width - per_seq)))),
    )
    q0 = jnp.full((batch, cfg.num_heads, cfg.head_dim), 0.01, dt)

    @jax.jit
    def attn_all(kv, q, md):
        acc = jnp.zeros((), jnp.float32)
        for i in range(cfg.num_layers):
            o = attention(
                q,
                kv.k[i],
                kv.v[i],
                md,
                scale=cfg.attn_scale,
                sliding_window=cfg.layer_window(i),
                soft_cap=cfg.attn_logit_softcap,
                backend=runner.backend,
            )
            acc += o.sum()
        return acc

    def t(fn):
        return 1e3 * common.median_time(lambda: jax.block_until_ready(fn()), repeats)[0]

    return {
        "batch": batch,
        "context": context,
        "matmuls_ms": t(lambda: matmuls(params, x0)),
        "lm_head_ms": t(lambda: lm_head(params, x0)),
        "attention_ms": t(lambda: attn_all(runner.kv, q0, md)),
    }


def profile_steps(llm, prompts, max_tokens: int, reset_cache) -> dict:
    """One more batch run with each engine step split into forward (dispatch until the logits are ready), sampler
    (until the ids are ready) and the host rest (scheduling, packing, detokenizing, outputs). Blocking between the
    parts removes the small host/device overlap the engine has, so the parts add up to slightly more than a step."""
    from netra_jax import SamplingParams
    from netra_jax.ops import sampling

    eng = llm.engine
    steps: list[dict] = []
    cur: dict = {}
    orig_run, orig_sample, orig_step = eng.runner.run, sampling.sample, eng.step

    def run(out, *prev):
        t0 = time.perf_counter()
        res = orig_run(out, *prev)
        res.logits.block_until_ready()
        cur.update(forward=time.perf_counter() - t0, tokens=res.batch.num_tokens, seqs=res.batch.num_seqs)
        return res

    def sample(*a, **kw):
        t0 = time.perf_counter()
        so = orig_sample(*a, **kw)
        so.token_ids.block_until_ready()
        cur["sampler"] = time.perf_counter() - t0
        return so

    def step():
        cur.clear()
        t0 = time.perf_counter()
        r = orig_step()
        if cur:
            steps.append(dict(cur, step=time.perf_counter() - t0))
        return r

    eng.runner.run, sampling.sample, eng.step = run, sample, step
    try:
        reset_cache()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        sampling.sample = orig_sample
        del eng.runner.run, eng.step  # back to the class methods
    full = [s for s in steps if s["seqs"] == len(prompts) and s["tokens"] == len(prompts)]
    rest = [s for s in steps if s not in full]

    def agg(ss, fn):
        return round(1e3 * fn([s[k] for s in ss]), 3) if ss else None

    out = {"num_steps": len(steps), "full_decode_steps": len(full)}
    for k in ("step", "forward", "sampler"):
        out[f"decode_{k}_ms_median"] = agg(full, lambda xs, k=k: statistics.median(xs))
    if full:
        host = [s["step"] - s["forward"] - s.get("sampler", 0.0) for s in full]
        out["decode_host_ms_median"] = round(1e3 * statistics.median(host), 3)
    out["other_steps"] = [
        {
            "tokens": s["tokens"],
            "seqs": s["seqs"],
            "step_ms": round(1e3 * s["step"], 2),
            "forward_ms": round(1e3 * s["forward"], 2),
        }
        for s in rest
    ][:16]
    return out


def decode_matmul_shapes(cfg, batch: int, repeats: int = 5) -> list[dict]:
    """GFLOP/s of each distinct matmul of a decode step at `batch` rows, as a lone jitted XLA `jnp.dot` and through
    numpy's BLAS, to show which shapes XLA runs far from the peak (gate/up is one [hidden, 2 * intermediate] dot)."""
    import jax
    import jax.numpy as jnp

    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "wq": (h, cfg.q_size),
        "wk/wv": (h, cfg.kv_size),
        "wo": (cfg.q_size, h),
        "gate_up": (h, 2 * i),
        "down": (i, h),
        "lm_head": (h, cfg.vocab_size),
    }
    rng = np.random.default_rng(0)
    dot = jax.jit(jnp.dot)
    out = []
    for name, (k, n) in shapes.items():
        a = rng.standard_normal((batch, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        flops = 2.0 * batch * k * n
        t_xla = common.median_time(lambda ja=ja, jb=jb: dot(ja, jb).block_until_ready(), repeats)[0]
        t_np = common.median_time(lambda a=a, b=b: a @ b, repeats)[0]
        out.append(
            {
                "name": name,
                "shape": [batch, k, n],
                "xla_ms": 1e3 * t_xla,
                "numpy_ms": 1e3 * t_np,
                "xla_gflops": flops / t_xla / 1e9,
                "numpy_gflops": flops / t_np / 1e9,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------- the sub-command
def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=3, repeats_help="timed calls of each part, their median")
    p.add_argument("--batches", default="1,32", help="decoding sequences per step, comma-separated")
    p.add_argument("--context", type=int, default=200, help="tokens of context of every sequence")
    p.add_argument("--quick", action="store_true", help="small peak tests (a 512 x 512 matmul, 32 MB copied)")


def run(a: argparse.Namespace) -> int:
    import jax

    record = common.Run("roofline")
    peaks = measure_peaks(a.quick)
    batches = [int(b) for b in a.batches.split(",")]
    llm = common.build_llm(a.model, max_num_seqs=max(batches), warmup=False)
    cfg = llm.model_config
    peak, bandwidth = peaks["matmul_peak_gflops"] * 1e9, peaks["bandwidth_gbs"] * 1e9
    quantized = quantized_file_bytes(a.model)
    rows = []
    for batch in batches:
        costs = decode_step_costs(cfg, batch, a.context, weights=quantized)
        floors = {
            "compute_ms": 1e3 * costs["flops_per_step"] / peak,
            "bandwidth_ms": 1e3 * costs["bytes_per_step"] / bandwidth,
        }
        parts = component_times(llm, batch, a.context, a.repeats)
        rows.append(
            {
                "batch": batch,
                "context": a.context,
                "costs": costs,
                "floors": floors,
                "parts": parts,
                # float32 XLA dots of the step's shapes: what a float model's matmuls could reach (not a GGUF's)
                "matmul_shapes": [] if quantized else decode_matmul_shapes(cfg, batch, a.repeats + 2),
            }
        )
        bound = max(floors, key=floors.get).removesuffix("_ms")
        print(
            f"batch {batch:3d} at {a.context}: floor {max(floors.values()):7.2f} ms ({bound}) | parts alone: "
            f"matmuls {parts['matmuls_ms']:7.2f}, lm_head {parts['lm_head_ms']:6.2f}, "
            f"attention {parts['attention_ms']:6.2f} ms",
            flush=True,
        )
    doc = record.record(
        model=common.model_label(a.model),
        dtype="float32",
        params_bytes=sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params)),
        peaks=peaks,
        rows=rows,
    )
    record.write(doc, a.out)
    return 0
