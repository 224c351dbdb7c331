"""Decode attention on CPU: the jnp reference's per-token path alone (jitted, one decode token per sequence) at long
contexts, against the path it replaced, in the same run; and the engine's decode step at a 6,000-token context.

Usage: `.venv/bin/python -m benchmarks.attention_decode [--contexts 512,2048,6000,8192] [--batches 1,8] [--repeats N]
[--engine] [--out PATH]`. Writes benchmarks/results/<date>-attention_decode.json and prints a table.

Attention alone: the default model's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, float32, the
default page size); every sequence has `context` keys on pages scattered over the cache, each "layer" its own cache
(so the pages are read from memory as in a real step, not from cache), and the time of one decode step's attention
(30 layers) is the time of the layers run, scaled to 30. "before" is the per-token path as it was (64-key chunks for
every token, kept here only for this comparison), "after" is netra_jax.ops.attention's. Timings are the minimum over
interleaved repeats, as wall time and as CPU time of this process (the latter is steadier on a shared machine).

--engine: the default model in float32 through LLM (no prefix caching, no warm-up): TPOT at a 6,000-token prompt =
(time of a 33-token greedy generate - time of a 1-token one) / 32, each on a fresh random prompt, for the reference
attention before and after (the old path patched into the module for the "before" engine).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.bench.machine import machine_info
from netra_jax.bench.results import write_result
from netra_jax.engine_config import CacheConfig
from netra_jax.ops.attention import AttentionMetadata, AttentionWork, build_work, paged_attention_reference
from netra_jax.ops.attention import reference as attn

HERE = Path(__file__).resolve().parent
Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
SCATTERED = "--in-order" not in sys.argv
LAYER_BYTES_CAP = 600 * 2**20  # KV bytes held at once across the layers timed


# ------------------------------------------------------------------------------------------ the path it replaced
def old_token_path(out, q, k_pages, v_pages, lay, idx, count, *, scale, sliding_window, soft_cap, sinks):
    """The per-token path before long-context decode: every token gathers 64 keys per step, its block looping over
    as many chunks as its longest token needs, scored by a broadcast multiply and sum."""
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    ppc = max(1, 64 // P)
    ck = ppc * P
    rows_all = attn._pad_pages(lay.rows, ppc)
    tb = min(64, idx.shape[0])
    if idx.shape[0] % tb:
        idx = jnp.pad(idx, (0, tb - idx.shape[0] % tb), constant_values=T)

    def block(b, out):
        ti = jax.lax.dynamic_slice_in_dim(idx, b * tb, tb)
        tc = jnp.minimum(ti, T - 1)
        live = (ti < T) & lay.valid[tc]
        pb = jnp.where(live, lay.q_pos[tc], -1)
        rows = rows_all[tc]
        qg = q[tc].astype(jnp.float32).reshape(tb, 1, KH, G, D) * scale
        lo = jnp.min(jnp.where(live, pb, jnp.iinfo(jnp.int32).max))

        def body(c, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(rows, c * ppc, ppc, axis=1)
            k = jnp.take(k_pages, pages, axis=0, mode="clip").reshape(tb, ck, KH, 1, D).astype(jnp.float32)
            v = jnp.take(v_pages, pages, axis=0, mode="clip").reshape(tb, ck, KH, 1, D).astype(jnp.float32)
            kpos = (c * ck + jnp.arange(ck, dtype=jnp.int32))[None, :, None, None]
            s, mask = attn.masked_scores((qg * k).sum(-1), kpos, pb[:, None, None, None], sliding_window, soft_cap)
            m_new = jnp.maximum(m, s.max(1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            return m_new, l * alpha + p.sum(1), acc * alpha[..., None] + (p[..., None] * v).sum(1)

        init = (*attn._softmax_init(sinks, (tb, KH, G)), jnp.zeros((tb, KH, G, D)))
        hi = jnp.where(live.any(), (jnp.max(pb) + ck) // ck, 0)
        _, l, acc = jax.lax.fori_loop(attn._first_chunk(lo, sliding_window, ck), hi, body, init)
        o = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(tb, H, D)
        return out.at[ti].set(o.astype(out.dtype), mode="drop")

    if idx.shape[0] == tb:
        return block(0, out)
    return jax.lax.fori_loop(0, (count + tb - 1) // tb, block, out)


NEW_TOKEN_PATH = attn._token_path


def use_path(which: str) -> None:
    """Trace later calls of the reference with the per-token path `which` ("before" or "after")."""
    attn._token_path = old_token_path if which == "before" else NEW_TOKEN_PATH
    parts = which.split("_")
    attn._WHOLE_KEYS = int(parts[1]) if len(parts) > 1 else 512
    attn._TAIL_KEYS = int(parts[2]) if len(parts) > 2 else 128


# -------------------------------------------------------------------------------------------- attention alone
def decode_case(batch: int, context: int, page: int, scattered: bool = True, seed: int = 0):
    """Queries, metadata and the page count of `batch` decode tokens, each with `context` keys on scattered pages."""
    rng = np.random.default_rng(seed)
    need = -(-context // page)
    num_pages = batch * need + 1
    perm = rng.permutation(num_pages) if scattered else np.arange(num_pages)
    width = -(-8192 // page)  # the block-table width of an engine at max_model_len 8192
    bt = np.zeros((batch, max(width, need)), np.int32)
    for s in range(batch):
        bt[s, :need] = perm[s * need : (s + 1) * need]
    md = AttentionMetadata(
        slot_mapping=jnp.full((batch,), num_pages * page, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
        seq_lens=jnp.full((batch,), context, jnp.int32),
        block_tables=jnp.asarray(bt),
    )
    md = md.replace(work=AttentionWork(*(jnp.asarray(a) for a in build_work([1] * batch, batch, batch))))
    q = jnp.asarray(rng.standard_normal((batch, Q_HEADS, HEAD_DIM)), jnp.float32)
    return q, md, num_pages


def step_attention(which: str):
    """A jitted function running the reference over each layer's cache (the path traced as `which`)."""

    def f(q, ks, vs, md):
        use_path(which)  # runs when traced
        return [paged_attention_reference(q, k, v, md, scale=HEAD_DIM**-0.5) for k, v in zip(ks, vs, strict=True)]

    return jax.jit(f)


def time_call(fn, *args) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_alone(contexts, batches, repeats, variants=("before", "after")) -> list[dict]:
    page = CacheConfig().page_size
    rows = []
    for batch in batches:
        for context in contexts:
            q, md, num_pages = decode_case(batch, context, page, scattered=SCATTERED)
            layer_bytes = 2 * num_pages * page * KV_HEADS * HEAD_DIM * 4
            layers = max(1, min(LAYERS, LAYER_BYTES_CAP // layer_bytes))
            rng = np.random.default_rng(1)
            shape = (num_pages, page, KV_HEADS, HEAD_DIM)
            ks = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(layers)]
            vs = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(layers)]
            fns = {w: step_attention(w) for w in variants}
            outs = {w: np.asarray(fn(q, ks, vs, md)[0]) for w, fn in fns.items()}  # compiles
            diff = max(float(np.abs(outs[w] - outs[variants[0]]).max()) for w in variants)
            best = {w: [float("inf"), float("inf")] for w in variants}
            for _ in range(repeats):
                for w, fn in fns.items():
                    wall, cpu = time_call(fn, q, ks, vs, md)
                    best[w] = [min(best[w][0], wall), min(best[w][1], cpu)]
            scale = LAYERS / layers * 1e3
            row = dict(batch=batch, context=context, layers_timed=layers, max_abs_diff=diff)
            for w in variants:
                row[f"{w}_wall_ms"] = round(best[w][0] * scale, 2)
                row[f"{w}_cpu_ms"] = round(best[w][1] * scale, 2)
            rows.append(row)
            cols = "  ".join(f"{w}: wall {row[f'{w}_wall_ms']:8.2f} cpu {row[f'{w}_cpu_ms']:8.2f}" for w in variants)
            print(f"batch {batch:2d} context {context:5d}  {cols}  (ms per 30-layer step)", flush=True)
            del ks, vs
    return rows


# --------------------------------------------------------------------------------------------------- end to end
def bench_engine(prompt_len: int, out_len: int, repeats: int) -> dict:
    """TPOT and TTFT of the default model (float32) at a long prompt, the reference attention before and after: the
    engine's own request metrics (TPOT = time from the first to the last token / tokens after the first)."""
    from netra_jax import LLM, SamplingParams

    rng = np.random.default_rng(0)
    engines = {}
    for which in ("before", "after"):
        use_path(which)  # each engine traces its step with this path
        engines[which] = LLM(dtype="float32", max_model_len=8192, enable_prefix_caching=False, warmup=False)

    def gen(which):
        use_path(which)  # a step variant compiled now traces this path
        ids = rng.integers(100, 49000, prompt_len).tolist()
        sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        m = engines[which].generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].metrics
        return m.tpot, m.ttft

    for w in engines:  # compiles every step variant the measurement uses
        gen(w)
    runs = {w: [] for w in engines}
    for _ in range(repeats):
        for w in engines:
            runs[w].append(gen(w))
    res = dict(prompt_len=prompt_len, output_len=out_len)
    for w, rs in runs.items():
        res[f"{w}_tpot_ms"] = round(min(r[0] for r in rs) * 1e3, 1)
        res[f"{w}_tpot_ms_all"] = [round(r[0] * 1e3, 1) for r in rs]
        res[f"{w}_ttft_s_all"] = [round(r[1], 2) for r in rs]
        tpots, ttfts = res[f"{w}_tpot_ms_all"], res[f"{w}_ttft_s_all"]
        print(f"engine {w}: TPOT {res[f'{w}_tpot_ms']:.1f} ms (all {tpots}), TTFT {ttfts} s")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,6000,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine", action="store_true", help="also time the engine's decode at a 6,000-token prompt")
    ap.add_argument("--engine-repeats", type=int, default=3)
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--in-order", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    result = dict(
        benchmark="attention_decode",
        date=dt.datetime.now().isoformat(timespec="seconds"),
        machine=machine_info(),
        shape=dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=CacheConfig().page_size),
        alone=bench_alone(contexts, batches, args.repeats, tuple(args.variants.split(","))),
    )
    if args.engine:
        result["engine"] = bench_engine(6000, 32, args.engine_repeats)
    write_result(result, "attention_decode", HERE / "results", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
