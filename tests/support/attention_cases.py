"""Attention test cases shared by the kernel, KV-quantization and gradient tests: random ragged paged batches
(`make_case`), a float64 dense attention to check them against, and shapes lowered for an abstract H200."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from netra_jax.ops.attention import AttentionMetadata

# The one warning these tests mean to silence: lowering a Triton kernel for CUDA announces the backend's removal.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def make_case(seqs, *, P, KH, G, D, dtype, pad_tokens=0, pad_seqs=0, seed=0, garbage=None):
    """Random ragged batch. seqs: [(cached tokens, new tokens)]; pages are scattered over the cache.

    garbage: if set, every K/V slot no sequence can see (past its length, unused pages) is filled with it."""
    rng = np.random.default_rng(seed)
    q_lens = [q for _, q in seqs] + [0] * pad_seqs
    seq_lens = [c + q for c, q in seqs] + [0] * pad_seqs
    need = [-(-n // P) for n in seq_lens]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    bt = np.zeros((len(seq_lens), max(max(need), 1)), np.int32)
    used = np.zeros((num_pages, P), bool)
    i = 0
    for s, n in enumerate(need):
        bt[s, :n] = perm[i : i + n]
        i += n
        for j in range(seq_lens[s]):
            used[bt[s, j // P], j % P] = True
    T = sum(q_lens) + pad_tokens
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.full((T,), num_pages * P, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(np.array(seq_lens, np.int32)),
        block_tables=jnp.asarray(bt),
    )
    q = rng.standard_normal((T, KH * G, D)).astype(np.float32)
    k = rng.standard_normal((num_pages, P, KH, D)).astype(np.float32)
    v = rng.standard_normal((num_pages, P, KH, D)).astype(np.float32)
    clean = tuple(jnp.asarray(a, dtype) for a in (q, k, v))
    if garbage is None:
        return (*clean, md)
    k, v = np.where(used[..., None, None], k, garbage), np.where(used[..., None, None], v, garbage)
    return (*clean, md), tuple(jnp.asarray(a, dtype) for a in (q, k, v))


MIXED = [(0, 21), (17, 1), (40, 1), (33, 12), (5, 1), (70, 3)]  # prefill, decodes, chunked prefills mid-sequence


DECODE = [(15, 1), (200, 1), (47, 1), (290, 1), (1, 1), (64, 1)]


H200 = AbstractMesh(
    (1,),
    ("x",),
    (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


def lower_h200(f, *args) -> str:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        with jax.sharding.use_abstract_mesh(H200):
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def abstract_inputs(T, S, H, KH, D, P, dtype, num_pages=2048, max_pages=256):
    s = jax.ShapeDtypeStruct
    md = AttentionMetadata(s((T,), jnp.int32), s((S + 1,), jnp.int32), s((S,), jnp.int32), s((S, max_pages), jnp.int32))
    return s((T, H, D), dtype), s((num_pages, P, KH, D), dtype), s((num_pages, P, KH, D), dtype), md


# per-head sink logits around the scores' range (scaled q.k of unit normals is ~N(0, 1)): some heads dominated by
# their sink, some barely touched by it
SINKS = np.array([2.5, -1.0, 0.3, 6.0, -4.0, 1.2, 0.0, 3.3], np.float32)


def dense(q, k, v, md, *, scale, sliding_window=None, soft_cap=None, sinks=None):
    """Numpy float64 attention of every real token over its sequence's visible keys. sinks: [q_heads] logits that
    join each head's softmax as one more column with no value (gpt-oss)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    qsl, lens, bt = (np.asarray(a) for a in (md.query_start_loc, md.seq_lens, md.block_tables))
    P, KH = k.shape[1], k.shape[2]
    G = q.shape[1] // KH
    out = np.zeros_like(q)
    for s in range(len(lens)):
        n_q = qsl[s + 1] - qsl[s]
        keys = np.concatenate([k[bt[s, j // P], j % P][None] for j in range(lens[s])]) if lens[s] else None
        vals = np.concatenate([v[bt[s, j // P], j % P][None] for j in range(lens[s])]) if lens[s] else None
        for i in range(n_q):
            t, pos = qsl[s] + i, lens[s] - n_q + i
            vis = np.arange(lens[s]) <= pos
            if sliding_window is not None:
                vis &= np.arange(lens[s]) > pos - sliding_window
            for h in range(q.shape[1]):
                sc = keys[:, h // G] @ q[t, h] * scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                sc = np.where(vis, sc, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(sc.max(), sink)
                p = np.exp(sc - top)
                out[t, h] = p @ vals[:, h // G] / (p.sum() + np.exp(sink - top))
    return out
