"""Section `correctness`: every GPU attention backend (Mosaic, Triton; their interpreters in the dry run) against the
jnp reference computed in float32 on the same device, in bf16 and f32, on a decode, a prefill and a mixed step and
on window / soft-cap / sink variants: max abs error, relative error ||out - ref|| / ||ref||, finiteness."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import Section, sig
from benchmarks.gpu_check.paged import GPU_BACKENDS, backend, make_batch, unsupported
from netra_jax.ops.attention import paged_attention_reference

# relative error bounds (METHOD.md: bf16 operands land between 1e-3 and 1e-2; f32 far under 1e-3)
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-3}


def cases(dry: bool) -> list[tuple[str, list[tuple[int, int]], dict]]:
    """(name, [(cached, new) per sequence], attention options)."""
    if dry:  # one step through every feature: prefill and decode rows, window, soft-cap, sinks
        return [("mixed_window_softcap_sinks", [(0, 9), (30, 1)], {"sliding_window": 8, "soft_cap": 30.0, "sinks": 1})]
    mixed = [(0, 37), (70, 1), (300, 1), (45, 9), (16, 1), (2000, 64)]
    return [
        ("decode", [(1023, 1), (16, 1), (4000, 1), (255, 1), (0, 1), (32767, 1)], {}),
        ("prefill", [(0, 512), (300, 200)], {}),
        ("mixed", mixed, {}),
        ("mixed_window_softcap_sinks", mixed, {"sliding_window": 64, "soft_cap": 30.0, "sinks": 1}),
        ("decode_window_past_pages", [(4000, 1), (700, 1), (90, 1)], {"sliding_window": 256}),
    ]


@functools.cache
def _jitted(fn, kw: tuple):
    return jax.jit(functools.partial(fn, **dict(kw)))


def compare(fn, seqs, opts: dict, dtype, sz, seed: int) -> dict:
    q, [(kp, vp)], md, _, _ = make_batch(
        seqs, heads=sz.heads, kv_heads=sz.kv_heads, head_dim=sz.head_dim, page_size=sz.page_size, dtype=dtype, seed=seed
    )
    kw = {"scale": sz.head_dim**-0.5, "sliding_window": opts.get("sliding_window"), "soft_cap": opts.get("soft_cap")}
    sinks = None
    if opts.get("sinks"):
        sinks = jax.random.normal(jax.random.key(seed + 7), (sz.heads,), jnp.float32)
    got = _jitted(fn, tuple(kw.items()))(q, kp, vp, md, sinks=sinks)
    f32 = [x.astype(jnp.float32) for x in (q, kp, vp)]
    with jax.default_matmul_precision("highest"):  # a GPU's f32 dots may otherwise run as TF32
        want = _jitted(paged_attention_reference, tuple(kw.items()))(*f32, md, sinks=sinks)
    got, want = np.asarray(got.astype(jnp.float32), np.float64), np.asarray(want, np.float64)
    err = got - want
    return {
        "tokens": int(q.shape[0]),
        "max_abs_err": sig(float(np.abs(err).max()), 3),
        "rel_err": sig(float(np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)), 3),
        "finite": bool(np.isfinite(got).all()),
    }


def run(sec: Section) -> None:
    sz = sec.sizes
    for name in GPU_BACKENDS:
        fn = backend(name, sec.dry)
        for dtype in (jnp.bfloat16, jnp.float32):
            dname = jnp.dtype(dtype).name
            for i, (case, seqs, opts) in enumerate(cases(sec.dry)):
                what = {"backend": name, "dtype": dname, "case": case}
                reason = unsupported(name, dtype, sz.heads, sz.kv_heads, sz.head_dim, sz.page_size)
                if reason:
                    sec.skip("results", what, reason)
                    continue
                measure = functools.partial(compare, fn, seqs, opts, dtype, sz, seed=i)
                row = sec.attempt("results", what, measure, need_s=5)
                if row is not None:
                    row["ok"] = bool(row["finite"] and row["rel_err"] is not None and row["rel_err"] < TOLERANCE[dname])
                    sec.save()
