"""Section `attention`: paged attention time and achieved bandwidth (K/V bytes read once per sequence, plus q and
the output, over the time) against the measured copy bandwidth, for decode over a batch x context grid and for mixed
prefill steps: Mosaic vs Triton vs XLA dense attention over gathered pages. Then the KV write: the runtime's XLA
scatter against the Pallas (Triton) kernel kept in benchmarks/kv_write_triton.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import Section, median_time, sig
from benchmarks.gpu_check.paged import GPU_BACKENDS, backend, dense_attention, make_batch, unsupported
from benchmarks.kv_write_triton import write_kv_triton
from netra_jax.ops.attention import write_kv
from netra_jax.ops.paged_attention_triton import attention_flops_bytes

ROTATE_BYTES = 256 << 20  # rotate through K/V copies until this much is touched: several times the 60 MB L2
DTYPE = jnp.bfloat16


def _timed(sec: Section, fn, q, caches, md, nbytes: int, flops: int) -> dict:
    f = jax.jit(fn)
    t = median_time(lambda i: f(q, *caches[i % len(caches)], md), jax.block_until_ready)
    row = {"us": sig(t * 1e6), "gbps": sig(nbytes / t / 1e9), "tflops": sig(flops / t / 1e12)}
    if sec.copy_gbps():
        row["frac_copy_bw"] = sig(nbytes / t / 1e9 / sec.copy_gbps(), 3)
    return row


def measure_step(sec: Section, kind: str, name: str, seqs) -> None:
    """One step shape through every backend; rows go to `kind` ("decode" or "mixed")."""
    sz = sec.sizes
    kv_bytes = 2 * sum(c + n for c, n in seqs) * sz.kv_heads * sz.head_dim * 2
    copies = int(np.clip(-(-ROTATE_BYTES // kv_bytes), 1, 8))
    need = 3 if sec.dry else 12
    if sec.left() < need:
        sec.skip(kind, {"shape": name}, f"time budget ({sec.left():.0f}s left)")
        return
    q, caches, md, q_lens, seq_lens = make_batch(
        seqs,
        heads=sz.heads,
        kv_heads=sz.kv_heads,
        head_dim=sz.head_dim,
        page_size=sz.page_size,
        dtype=DTYPE,
        copies=copies,
    )
    flops, nbytes = attention_flops_bytes(q_lens, seq_lens, sz.heads, sz.kv_heads, sz.head_dim, 2)
    base = {"shape": name, "batch": len(seqs), "tokens": sum(q_lens), "max_context": max(seq_lens)}
    base["kv_mib"] = round(kv_bytes / 2**20, 1)
    scale = sz.head_dim**-0.5
    for bname in GPU_BACKENDS:
        what = {**base, "impl": bname}
        fn = backend(bname, sec.dry)
        reason = unsupported(bname, DTYPE, sz.heads, sz.kv_heads, sz.head_dim, sz.page_size)
        if reason:
            sec.skip(kind, what, reason)
            continue
        call = functools.partial(fn, scale=scale)
        sec.attempt(kind, what, functools.partial(_timed, sec, call, q, caches, md, nbytes, flops), need_s=need)
    what = {**base, "impl": "xla_dense"}
    uniform = len(set(seqs)) == 1
    if not uniform:
        sec.skip(kind, what, "ragged step: dense attention needs one (context, new tokens) shape per batch")
    else:
        cached, new = seqs[0]
        call = functools.partial(dense_attention, scale=scale, q_len=new, context=cached + new)
        sec.attempt(kind, what, functools.partial(_timed, sec, call, q, caches, md, nbytes, flops), need_s=need)


def kv_write_impls(dry: bool) -> dict:
    """The runtime's KV write (XLA's scatter) and the Pallas Triton kernel kept in benchmarks/ to compare with."""
    return {"xla_scatter": write_kv, "pallas_triton": functools.partial(write_kv_triton, interpret=dry)}


def measure_kv_write(sec: Section) -> None:
    sz = sec.sizes
    num_pages = 256 if sec.dry else 65536  # the full run: 2 x 2 GiB of bf16 pages
    shape = (num_pages, sz.page_size, sz.kv_heads, sz.head_dim)
    impls = kv_write_impls(sec.dry)
    if "pallas_triton" not in impls:
        sec.skip("kv_write", {"impl": "pallas_triton"}, "benchmarks/kv_write_triton.py not found")
    for T in (16,) if sec.dry else (256, 2048):
        slots = np.random.default_rng(T).permutation(num_pages * sz.page_size)[:T].astype(np.int32)
        k = jax.random.normal(jax.random.key(T), (T, sz.kv_heads, sz.head_dim), DTYPE)
        for name, fn in impls.items():
            sec.attempt("kv_write", {"impl": name, "tokens": T}, functools.partial(_time_write, fn, shape, k, slots), 3)


def _time_write(fn, shape, k, slots) -> dict:
    """Median time of the write with the cache donated (in place), and a check that it wrote what it should."""
    f = jax.jit(fn, donate_argnums=(0, 1))
    kp, vp = jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE)
    state = {"kv": (kp, vp)}
    slots = jnp.asarray(slots)

    def call(i):
        state["kv"] = f(*state["kv"], k, k, slots)
        return state["kv"][0]

    t = median_time(call, jax.block_until_ready)
    n, p, h, d = shape
    got = np.asarray(state["kv"][0].reshape(n * p, h, d)[slots], np.float32)
    moved = 2 * k.size * k.dtype.itemsize * 2  # K and V: read the new rows, write them
    return {
        "us": sig(t * 1e6),
        "written_ok": bool(np.array_equal(got, np.asarray(k, np.float32))),
        "gbps": sig(moved / t / 1e9),
    }


def run(sec: Section) -> None:
    sz = sec.sizes
    for b, ctx in sz.decode_grid:
        measure_step(sec, "decode", f"b{b}_ctx{ctx}", [(ctx - 1, 1)] * b)
    for name, seqs in sz.mixed_steps:
        measure_step(sec, "mixed", name, list(seqs))
    measure_kv_write(sec)
