"""GPU check of the Pallas attention kernels: correctness against the jnp reference in bf16, kernel vs XLA timings
for decode and prefill, measured copy/matmul peaks, a kernel config sweep, KV-write timing and a Llama-3-8B step."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
import traceback
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# netra_jax/__init__.py pulls in the serving stack (tokenizers, safetensors, ...), absent on the GPU machine: register
# the package bare so only the modules below (jax, flax and numpy only) are imported.
if "netra_jax" not in sys.modules:
    _pkg = types.ModuleType("netra_jax")
    _pkg.__path__ = [str(REPO / "netra_jax")]
    sys.modules["netra_jax"] = _pkg

from models.transformer import KVCache, forward  # noqa: E402
from netra_jax.config import ModelConfig, RopeConfig  # noqa: E402
from netra_jax.ops.attention import AttentionMetadata, paged_attention_reference, write_kv  # noqa: E402
from netra_jax.ops.kv_write_triton import write_kv_triton  # noqa: E402
from netra_jax.ops.paged_attention_triton import KernelConfig, attention_flops_bytes, paged_attention_triton  # noqa: E402


class Run:
    """Holds the results, the time budget and the sizes of a full or a dry run."""

    def __init__(self, out_dir: Path, dry: bool, budget_s: float):
        self.out, self.dry, self.t0, self.budget = out_dir, dry, time.time(), budget_s
        self.res: dict = {"dry_run": dry, "errors": {}}
        self.interpret = dry
        self.reserve = 5.0 if dry else 90.0  # seconds kept for the sections after a timing loop

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.time() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.res, indent=1))

    def section(self, name, fn) -> None:
        t = time.time()
        print(f"== {name} (t={t - self.t0:.0f}s, {self.left():.0f}s left)", flush=True)
        try:
            fn(self)
        except Exception:
            self.res["errors"][name] = traceback.format_exc()[-4000:]
            print(self.res["errors"][name], flush=True)
        self.save()


def timeit(f, *args, reps: int = 5, inner: int = 10) -> float:
    """Median over `reps` of the mean of `inner` back-to-back dispatches (warm, block_until_ready); seconds."""
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    if time.perf_counter() - t > 0.5:  # slow case: fewer repetitions
        reps, inner = 2, 1
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            r = f(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)


def make_batch(q_lens, ctx_lens, *, H, KH, D, P, dtype, seed=0):
    """Device arrays for a ragged batch: sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones, its pages
    scattered over the cache by a random permutation."""
    rng = np.random.default_rng(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-n // P) for n in seq_lens]
    num_pages = sum(need) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = np.zeros((len(need), max(need)), np.int32)
    i = 0
    for s, n in enumerate(need):
        bt[s, :n] = perm[i : i + n]
        i += n
    T = sum(q_lens)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((T,), jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        seq_lens=jnp.asarray(np.array(seq_lens, np.int32)),
        block_tables=jnp.asarray(bt),
    )
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (T, H, D), dtype)
    kp = jax.random.normal(k2, (num_pages, P, KH, D), dtype)
    vp = jax.random.normal(k3, (num_pages, P, KH, D), dtype)
    return q, kp, vp, md


@functools.cache
def _kernel_fn(interpret: bool, config, kw: tuple):
    return jax.jit(functools.partial(paged_attention_triton, interpret=interpret, config=config, **dict(kw)))


def kernel_fn(run: Run, config=None, **kw):
    """The jitted kernel for these static arguments (cached, so equal shapes reuse the compiled executable)."""
    return _kernel_fn(run.interpret, config, tuple(sorted(kw.items())))


# ------------------------------------------------------------------ sections


def env(run: Run) -> None:
    d = jax.devices()[0]
    run.res["env"] = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": d.device_kind,
        "num_devices": jax.device_count(),
        "interpret": run.interpret,
    }
    print(run.res["env"], flush=True)


def peaks(run: Run) -> None:
    n = (1 << 22) if run.dry else (1 << 31)  # bf16 elements: 8 MiB / 4 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    t = timeit(jax.jit(lambda a: a + 1), x, inner=3)
    copy_gbps = 2 * n * 2 / t / 1e9  # read + write
    del x
    best = 0.0
    for m in (256, 512) if run.dry else (4096, 8192, 16384):
        a = jnp.ones((m, m), jnp.bfloat16)
        t = timeit(jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.bfloat16)), a, a, inner=3)
        best = max(best, 2 * m**3 / t / 1e12)
    run.res["peaks"] = {"copy_gbps": float(f"{copy_gbps:.4g}"), "matmul_tflops": float(f"{best:.4g}")}
    print(run.res["peaks"], flush=True)


def correctness(run: Run) -> None:
    H, KH, D = (8, 2, 64) if run.dry else (32, 8, 128)
    cases = [  # (name, q_lens, ctx_lens, window, cap, config)
        ("mixed", [37, 1, 1, 9, 1], [0, 70, 300, 45, 16], None, None, None),
        ("decode_split", [1] * 4, [1000, 17, 4000, 257], None, None, KernelConfig(16, 64, 8)),
        ("window_cap", [20, 1, 1], [100, 700, 33], 64, 30.0, None),
        ("prefill_long", [512], [300], None, None, None),
    ]
    if run.dry:  # one case through every feature: prefill, decode, split-K, window, soft-cap
        cases = [("dry_mixed", [9, 1, 1], [0, 60, 33], 24, 30.0, KernelConfig(16, 16, 2))]
    out = []
    for name, ql, cl, window, cap, cfg in cases:
        q, kp, vp, md = make_batch(ql, cl, H=H, KH=KH, D=D, P=16, dtype=jnp.bfloat16)
        kw = dict(scale=D**-0.5, sliding_window=window, soft_cap=cap)
        got = kernel_fn(run, cfg, **kw)(q, kp, vp, md).astype(jnp.float32)
        want = jax.jit(functools.partial(paged_attention_reference, **kw))(q, kp, vp, md).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)))
        out.append({"case": name, "max_abs_err": err, "ok": bool(err < 3e-2 and jnp.isfinite(got).all())})
        print(out[-1], flush=True)
    run.res["correctness"] = out


def _attn_row(run: Run, kind: str, q_lens, ctx_lens, H, KH, D, P, config=None, with_ref=True):
    q, kp, vp, md = make_batch(q_lens, ctx_lens, H=H, KH=KH, D=D, P=P, dtype=jnp.bfloat16)
    kw = dict(scale=D**-0.5)
    t_k = timeit(kernel_fn(run, config, **kw), q, kp, vp, md)
    flops, nbytes = attention_flops_bytes(q_lens, [c + x for c, x in zip(ctx_lens, q_lens, strict=True)], H, KH, D, 2)
    row = {"kind": kind, "batch": len(q_lens), "q_len": q_lens[0], "context": ctx_lens[0] + q_lens[0]}
    row |= {"kernel_us": round(t_k * 1e6, 1), "kernel_gbps": float(f"{nbytes / t_k / 1e9:.4g}")}
    row["kernel_tflops"] = float(f"{flops / t_k / 1e12:.4g}")
    pk = run.res.get("peaks", {})
    if pk.get("copy_gbps") and pk.get("matmul_tflops"):
        row["frac_copy_bw"] = round(row["kernel_gbps"] / pk["copy_gbps"], 3)
        row["frac_matmul"] = round(row["kernel_tflops"] / pk["matmul_tflops"], 3)
    if with_ref and run.left() > run.reserve:
        t_r = timeit(jax.jit(functools.partial(paged_attention_reference, **kw)), q, kp, vp, md, reps=3, inner=2)
        row["xla_ref_us"] = round(t_r * 1e6, 1)
        row["speedup_vs_xla"] = round(t_r / t_k, 2)
    print(row, flush=True)
    del q, kp, vp, md
    return row


def decode(run: Run) -> None:
    H, KH, D, P = (8, 2, 64, 16) if run.dry else (32, 8, 128, 16)
    batches, ctxs, cap = (1, 16, 64, 256), (1024, 4096, 8192, 32768), 1 << 21  # at most 8 GiB of K/V
    if run.dry:
        batches, ctxs = (4,), (64,)
    rows = run.res.setdefault("decode", [])
    for b in batches:
        for c in ctxs:
            if b * c > cap or run.left() < run.reserve:
                continue
            rows.append(_attn_row(run, "decode", [1] * b, [c - 1] * b, H, KH, D, P))
            run.save()


def prefill(run: Run) -> None:
    H, KH, D, P = (8, 2, 64, 16) if run.dry else (32, 8, 128, 16)
    rows = run.res.setdefault("prefill", [])
    for n in (64,) if run.dry else (1024, 2048, 4096, 8192):
        if run.left() < run.reserve:
            break
        rows.append(_attn_row(run, "prefill", [n], [0], H, KH, D, P, with_ref=not run.dry))
        run.save()


def sweep(run: Run) -> None:
    """A few launch configurations on one decode and one prefill shape, to tune the defaults."""
    H, KH, D, P = (8, 2, 64, 16) if run.dry else (32, 8, 128, 16)
    dec = ([1] * 4, [63] * 4) if run.dry else ([1] * 64, [4095] * 64)
    pre = ([128], [0]) if run.dry else ([4096], [0])
    cfgs = {
        "decode": [(16, 32, 1, 4, 3), (16, 64, 1, 4, 3), (16, 128, 1, 4, 2), (16, 64, 2, 4, 3), (32, 64, 1, 4, 3)],
        "prefill": [(64, 64, 1, 4, 3), (64, 32, 1, 4, 3), (128, 64, 1, 8, 3), (128, 32, 1, 4, 3), (64, 128, 1, 8, 2)],
    }
    rows = run.res.setdefault("sweep", [])
    for kind, (ql, cl) in (("decode", dec),) if run.dry else (("decode", dec), ("prefill", pre)):
        q, kp, vp, md = make_batch(ql, cl, H=H, KH=KH, D=D, P=P, dtype=jnp.bfloat16)
        for c in cfgs[kind][: 1 if run.dry else None]:
            if run.left() < run.reserve:
                return
            cfg = KernelConfig(*c)
            try:
                t = timeit(kernel_fn(run, cfg, scale=D**-0.5), q, kp, vp, md)
                rows.append({"kind": kind, "config": list(c), "us": round(t * 1e6, 1)})
            except Exception as e:  # a config Triton cannot compile (e.g. shared memory) is a result too
                rows.append({"kind": kind, "config": list(c), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(rows[-1], flush=True)
            run.save()


def kv_write(run: Run) -> None:
    KH, D, P = (2, 64, 16) if run.dry else (8, 128, 16)
    num_pages = 256 if run.dry else 65536  # 2 x 2 GiB of bf16 pages in the full run
    rows = run.res.setdefault("kv_write", [])
    for T in (16,) if run.dry else (256, 8192):
        kp = jnp.zeros((num_pages, P, KH, D), jnp.bfloat16)
        vp = jnp.zeros((num_pages, P, KH, D), jnp.bfloat16)
        k = jnp.ones((T, KH, D), jnp.bfloat16)
        slots = jnp.asarray(np.random.default_rng(0).permutation(num_pages * P)[:T].astype(np.int32))
        row = {"tokens": T, "cache_bytes": 2 * kp.size * 2}
        fns = {
            "xla_scatter_donated": jax.jit(write_kv, donate_argnums=(0, 1)),
            "pallas_aliased": jax.jit(
                functools.partial(write_kv_triton, interpret=run.interpret), donate_argnums=(0, 1)
            ),
        }
        for name, f in fns.items():
            kp, vp = f(kp, vp, k, k, slots)
            jax.block_until_ready(kp)
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                kp, vp = f(kp, vp, k, k, slots)
                jax.block_until_ready(kp)
                ts.append(time.perf_counter() - t)
            row[name + "_us"] = round(statistics.median(ts) * 1e6, 1)
        rows.append(row)
        print(row, flush=True)
        del kp, vp


def llama_config(dry: bool) -> ModelConfig:
    L, hid, heads, kvh, hd, inter, vocab = (
        (2, 128, 8, 2, 16, 256, 512) if dry else (32, 4096, 32, 8, 128, 14336, 128256)
    )
    return ModelConfig(
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=vocab,
        hidden_size=hid,
        intermediate_size=inter,
        num_layers=L,
        num_heads=heads,
        num_kv_heads=kvh,
        head_dim=hd,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        layer_types=("full_attention",) * L,
        rope_full=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0),
        rope_sliding=RopeConfig(theta=500000.0),
        attn_scale=hd**-0.5,
    )


def random_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    H, I, V, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_size, cfg.kv_size
    key = iter(jax.random.split(jax.random.key(0), 8 * cfg.num_layers + 8))

    @functools.partial(jax.jit, static_argnums=(1,))
    def rnd(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype)

    def layer():
        return {
            "attn_norm": jnp.ones((H,), jnp.float32),
            "wq": rnd(next(key), (H, q)),
            "wk": rnd(next(key), (H, kv)),
            "wv": rnd(next(key), (H, kv)),
            "wo": rnd(next(key), (q, H)),
            "mlp_norm": jnp.ones((H,), jnp.float32),
            "w_gate_up": rnd(next(key), (H, 2, I)),
            "w_down": rnd(next(key), (I, H)),
        }

    layers = [layer() for _ in range(cfg.num_layers)]
    embed, head = rnd(next(key), (V, H)), rnd(next(key), (H, V))
    return {"embed": embed, "lm_head": head, "final_norm": jnp.ones((H,), jnp.float32), "layers": layers}


def e2e_decode(run: Run) -> None:
    cfg = llama_config(run.dry)
    params = random_params(cfg)
    ctx, P = (40, 16) if run.dry else (1024, 16)
    wbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    # the reference at batch 1 and 256 last: they matter least
    plan = [(1, "triton"), (64, "triton"), (256, "triton"), (64, "reference"), (1, "reference"), (256, "reference")]
    if run.dry:
        plan = [(2, "triton_interpret"), (2, "reference")]
    rows = run.res.setdefault("e2e_decode", [])
    for B, backend in plan:
        if run.left() < (run.reserve if run.dry else 120):
            rows.append({"batch": B, "backend": backend, "skipped": "time budget"})
            continue
        pages_per_seq = -(-(ctx + 1) // P)
        n_pages = B * pages_per_seq
        shape = (n_pages, P, cfg.num_kv_heads, cfg.head_dim)
        kv = KVCache(
            k=[jnp.zeros(shape, jnp.bfloat16) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, jnp.bfloat16) for _ in range(cfg.num_layers)],
        )
        bt = jnp.arange(n_pages, dtype=jnp.int32).reshape(B, pages_per_seq)
        md = AttentionMetadata(
            slot_mapping=bt[:, ctx // P] * P + ctx % P,
            query_start_loc=jnp.arange(B + 1, dtype=jnp.int32),
            seq_lens=jnp.full((B,), ctx + 1, jnp.int32),
            block_tables=bt,
        )
        ids, pos = jnp.zeros((B,), jnp.int32), jnp.full((B,), ctx, jnp.int32)
        step = jax.jit(
            functools.partial(forward, cfg=cfg, backend=backend),
            donate_argnames=("kv",),
        )
        t = time.perf_counter()
        logits, kv = step(params, token_ids=ids, positions=pos, kv=kv, md=md)
        jax.block_until_ready(logits)
        compile_s = time.perf_counter() - t
        ts = []
        for _ in range(3 if run.dry else 8):
            t = time.perf_counter()
            logits, kv = step(params, token_ids=ids, positions=pos, kv=kv, md=md)
            jax.block_until_ready(logits)
            ts.append(time.perf_counter() - t)
        ms = statistics.median(ts) * 1e3
        kv_bytes = 2 * cfg.num_layers * B * (ctx + 1) * cfg.kv_size * 2
        row = {"batch": B, "backend": backend, "context": ctx + 1, "step_ms": round(ms, 3)}
        row |= {"tok_per_s": round(B / ms * 1e3, 1), "compile_s": round(compile_s, 1)}
        pk = run.res.get("peaks", {})
        if pk.get("copy_gbps"):  # a step reads every weight and the live KV once: its floor at the copy bandwidth
            row["bw_floor_ms"] = round((wbytes + kv_bytes) / (pk["copy_gbps"] * 1e9) * 1e3, 3)
        rows.append(row)
        print(row, flush=True)
        run.save()
        del kv, logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU with the Pallas interpreter")
    ap.add_argument("--budget", type=float, default=None, help="seconds before remaining sections are skipped")
    a = ap.parse_args(argv)
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, a.dry_run, a.budget or (100.0 if a.dry_run else 540.0))
    if not a.dry_run and jax.default_backend() != "gpu":
        print("no GPU visible to jax; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    order = [env, peaks, correctness, decode, prefill, e2e_decode, kv_write, sweep]
    for fn in order:
        run.section(fn.__name__, fn)
    print(json.dumps({k: v for k, v in run.res.items() if k != "errors"})[:4000])
    print(f"errors in: {sorted(run.res['errors'])}" if run.res["errors"] else "no errors", flush=True)
    return 1 if run.res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
