"""Roofline helpers: machine peaks (f32 matmul via numpy BLAS and XLA `jnp.dot`, copy bandwidth), load during a phase,
the FLOPs and bytes of a decode step, and where an engine's decode step spends its time (step split, forward parts)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def _median_time(fn: Callable[[], object], repeats: int, min_time: float = 0.0) -> tuple[float, list[float]]:
    """Median seconds of `fn()` over `repeats` calls (after one untimed call); keeps going until `min_time` spent."""
    fn()
    times: list[float] = []
    t_start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - t_start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * repeats:
            break
    return statistics.median(times), times


def numpy_sgemm_gflops(n: int = 2048, repeats: int = 7) -> dict:
    """float32 [n, n] @ [n, n] through numpy's BLAS; GFLOP/s from the median and the best call."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    med, times = _median_time(lambda: np.matmul(a, b, out=c), repeats)
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
    med, times = _median_time(lambda: f(a, b).block_until_ready(), repeats)
    flops = 2.0 * m * k * n
    return {"shape": [m, k, n], "median_s": med, "gflops": flops / med / 1e9, "best_gflops": flops / min(times) / 1e9}


def copy_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Large float32 `np.copyto`: GB/s counting the bytes read plus the bytes written (STREAM 'copy' convention)."""
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    med, times = _median_time(lambda: np.copyto(dst, src), repeats)
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


def decode_step_costs(cfg, batch: int, context: float, itemsize: int = 4) -> dict:
    """FLOPs and bytes of one decode step of `batch` sequences with a mean context of `context` tokens."""
    return {
        "batch": batch,
        "mean_context": context,
        "matmul_params": matmul_params(cfg),
        "flops_per_token": flops_per_token(cfg, context),
        "flops_per_step": batch * flops_per_token(cfg, context),
        "weight_bytes": weight_bytes(cfg, itemsize),
        "kv_bytes_per_step": batch * kv_bytes_per_token(cfg, context, itemsize),
        "bytes_per_step": weight_bytes(cfg, itemsize) + batch * kv_bytes_per_token(cfg, context, itemsize),
    }


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


QUIET_CORES = 0.2  # a run counts as quiet when other processes used less CPU than this on average


def figures(cfg, itemsize: int, prompt_ids, args, peaks: dict, ours: dict, hf: dict | None) -> dict:
    """The headline numbers: tok/s, ours/HF ratios, fractions of the matmul peak and of the batch-1 bandwidth
    roofline, from the median runs (`ours` / `hf` hold `batch` and `batch1` summaries)."""
    peak, bw = peaks["matmul_peak_gflops"] * 1e9, peaks["bandwidth_gbs"] * 1e9
    lens = [len(p) for p in prompt_ids]
    n = args.max_tokens
    ctx = statistics.mean(lens) + n / 2  # mean context of the decode tokens
    fpt = flops_per_token(cfg, ctx)
    attn1 = attention_flops_per_token(cfg, 1.0)  # per key (full-attention layers)
    run_flops = sum((L + n - 1) * 2.0 * matmul_params(cfg) + attn1 * (L + n - 1) * (L + n) / 2 for L in lens)
    ob, o1 = ours["batch"]["median"], ours["batch1"]["median"]
    ctx1 = lens[0] + args.batch1_tokens / 2
    bytes1 = weight_bytes(cfg, itemsize) + kv_bytes_per_token(cfg, ctx1, itemsize)
    f = {
        "costs_batch": decode_step_costs(cfg, len(prompt_ids), ctx, itemsize),
        "costs_batch1": decode_step_costs(cfg, 1, ctx1, itemsize),
        "ours_tok_s": ob["tok_s"],
        "ours_total_s": ob["total_s"],
        "ours_decode_tok_s": ob["decode_tok_s"],
        "ours_prefill_s": ob["prefill_s"],
        "ours_frac_peak": ob["tok_s"] * fpt / peak,
        "ours_frac_peak_decode_only": ob["decode_tok_s"] * fpt / peak,
        "ours_frac_peak_all_flops": run_flops / ob["total_s"] / peak,
        "ours_batch1_tok_s": o1["tok_s"],
        "ours_batch1_decode_tok_s": o1["decode_tok_s"],
        "batch1_roofline_tok_s": bw / bytes1,
        "ours_batch1_frac_roofline": o1["decode_tok_s"] / (bw / bytes1),
    }
    if hf and "batch" in hf:
        hb, h1 = hf["batch"]["median"], hf["batch1"]["median"]
        f.update(
            hf_tok_s=hb["tok_s"],
            hf_total_s=hb["total_s"],
            ratio=ob["tok_s"] / hb["tok_s"],
            hf_frac_peak=hb["tok_s"] * fpt / peak,
            hf_frac_peak_all_flops=run_flops / hb["total_s"] / peak,
            hf_batch1_tok_s=h1["tok_s"],
            ratio_batch1=o1["tok_s"] / h1["tok_s"],
            hf_batch1_frac_roofline=h1["tok_s"] / (bw / bytes1),
        )
        if hf["batch"].get("paired_ratios"):
            f["ratio_paired_median"] = statistics.median(hf["batch"]["paired_ratios"])
        for name in ("batch", "batch1"):  # pairs in which other processes used under QUIET_CORES
            quiet = [
                (o["tok_s"], h["tok_s"])
                for o, h in zip(ours[name]["runs"], hf[name]["runs"], strict=False)
                if max(o.get("others_cores") or 0, h.get("others_cores") or 0) < QUIET_CORES
            ]
            f[f"quiet_pairs_{name}"] = len(quiet)
            if quiet:
                f[f"ours_tok_s_quiet_{name}"] = statistics.median(o for o, _ in quiet)
                f[f"hf_tok_s_quiet_{name}"] = statistics.median(h for _, h in quiet)
                f[f"ratio_quiet_{name}"] = statistics.median(o / h for o, h in quiet)
    return f


# ---------------------------------------------------------------------------------------------------- where time goes
def component_times(llm, batch: int, context: int, repeats: int = 3) -> dict:
    """Median ms of the parts of one decode step of `batch` sequences at `context` tokens, each jitted alone on the
    engine's real parameters: all layers' projections chained (no attention), the lm-head, and the attention
    backend over every layer's paged cache. The rest of a forward (norms, RoPE, KV write, embedding) is the gap."""
    import jax
    import jax.numpy as jnp

    from netra_jax.ops.attention import AttentionMetadata, attention

    runner, cfg = llm.engine.runner, llm.model_config
    params = runner.params
    dt = jax.tree.leaves(params)[0].dtype
    x0 = jnp.full((batch, cfg.hidden_size), 0.01, dt)

    @jax.jit
    def matmuls(params, x):
        side = jnp.zeros((), jnp.float32)
        for lp in params["layers"]:
            if "wqkv" in lp:  # the engine's CPU layout: q, k and v in one matmul
                qkv = x @ lp["wqkv"]
                q = qkv[:, : cfg.q_size]
                side += qkv[:, cfg.q_size :].sum()
            else:
                q = x @ lp["wq"]
                side += (x @ lp["wk"]).sum() + (x @ lp["wv"]).sum()
            gu = jnp.einsum("th,hki->tki", x, lp["w_gate_up"])
            x = x + 1e-3 * (q @ lp["wo"] + (gu[:, 0] * gu[:, 1]) @ lp["w_down"])
        return x, side

    @jax.jit
    def lm_head(params, x):
        return jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)

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
        return 1e3 * _median_time(lambda: jax.block_until_ready(fn()), repeats)[0]

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
        t_xla = _median_time(lambda ja=ja, jb=jb: dot(ja, jb).block_until_ready(), repeats)[0]
        t_np = _median_time(lambda a=a, b=b: a @ b, repeats)[0]
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
