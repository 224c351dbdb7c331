"""The reference's per-token (decode) path at long contexts: whole chunks plus a tail against the float64 dense
reference, and the same result for a token whatever its step holds: run inside a multi-token per-token run
(speculative verification) or decoded alone, with or without batch companions (equal up to float rounding: XLA's
code for a block of tokens may differ with the block's size, as the model's matmuls differ with the batch's)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import SINKS, dense, make_case

from netra_jax.ops.attention import (
    AttentionMetadata,
    AttentionWork,
    build_work,
    decode_chunks,
    paged_attention_reference,
)

# (cached, new) per sequence: decodes on both sides of a whole chunk's end (512 keys at 16-token pages), a long one,
# a prefill crossing it and a short one
LONG_DECODE = [(1100, 1), (510, 1), (511, 1), (512, 1), (40, 1), (0, 530), (600, 5)]

CONFIGS = [
    (dict(G=3, D=64, P=16, KH=3), jnp.float32, {}),  # the default model's shape
    (dict(G=1, D=128, P=32, KH=2), jnp.float32, dict(sliding_window=300)),
    (dict(G=8, D=64, P=16, KH=1), jnp.float32, dict(soft_cap=5.0, sinks=SINKS)),
    (dict(G=2, D=64, P=128, KH=2), jnp.bfloat16, {}),
    (dict(G=4, D=128, P=16, KH=2), jnp.float32, dict(sliding_window=700, sinks=SINKS)),
]
IDS = ["gqa3", "mha_window", "mqa8_softcap_sinks", "gqa2_bf16_page128", "gqa4_window_sinks"]


def _kw(kw, H):
    return dict(kw, sinks=jnp.asarray(kw["sinks"][:H])) if "sinks" in kw else kw


def _reference(q, k, v, md, kw):
    return jax.jit(lambda q, k, v, md: paged_attention_reference(q, k, v, md, scale=0.125, **kw))(q, k, v, md)


def test_decode_chunks_tile_whole_chunks_with_tail_chunks():
    for page in (1, 16, 24, 32, 48, 128, 512, 1024):
        tail, whole = decode_chunks(page)
        assert tail >= 1 and whole % tail == 0, page


@pytest.mark.parametrize("shape,dtype,kw", CONFIGS, ids=IDS)
def test_long_contexts_match_dense(shape, dtype, kw):
    q, k, v, md = make_case(LONG_DECODE, dtype=dtype, pad_tokens=3, pad_seqs=1, **shape)
    kw = _kw(kw, q.shape[1])
    T, S = q.shape[0], md.seq_lens.shape[0]
    up = lambda a: np.asarray(a, np.float32)  # noqa: E731  (dense of the values the cache really holds)
    want = dense(up(q), up(k), up(v), md, scale=0.125, **kw)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2  # bf16: the output's own rounding
    work = AttentionWork(*(jnp.asarray(a) for a in build_work([n for _, n in LONG_DECODE], T, S)))
    for meta in (md, md.replace(work=work)):  # every token per token; decodes per token, the prefill in blocks
        out = np.asarray(_reference(q, k, v, meta, kw), np.float32)
        np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
        assert not out[int(md.query_start_loc[-1]) :].any(), "padding tokens must give zeros"


def _step(bt, seqs, num_tokens, per_token):
    """Metadata of a step over the block tables bt: seqs = [(block-table row, context length after the step, new
    tokens)], padded to num_tokens tokens and one idle sequence; work lists as the engine builds them."""
    q_lens = [n for _, _, n in seqs] + [0]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.full((num_tokens,), 10**6, jnp.int32),  # the keys are in the pages already
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(np.array([n for _, n, _ in seqs] + [0], np.int32)),
        block_tables=jnp.asarray(np.stack([bt[r] for r, _, _ in seqs] + [np.zeros_like(bt[0])])),
    )
    flags = [per_token] * len(seqs) + [False]
    work = build_work(q_lens, num_tokens, len(q_lens), per_token=flags)
    return md.replace(work=AttentionWork(*(jnp.asarray(a) for a in work)))


@pytest.mark.parametrize("shape,dtype,kw", CONFIGS, ids=IDS)
def test_per_token_run_matches_lone_decodes(shape, dtype, kw):
    """A run of k + 1 tokens of one sequence sent through the per-token path (speculative verification: their keys
    already written, each token sees only those before it) gives each token exactly the bits it gets when decoded
    alone in a later step, with a longer companion decode or none, in other token buckets: the same keys in the same
    chunks, so equal up to the last bits of float32 (a wrong mask or chunk would be off by far more)."""
    cached, run = 507, 8  # positions 507..514: the run crosses the end of a whole chunk
    seqs = [(cached, run), (1300, 1)]
    q, k, v, md = make_case(seqs, dtype=dtype, **shape)
    kw = _kw(kw, q.shape[1])
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == jnp.float32 else dict(atol=1e-2, rtol=1e-2)
    same = functools.partial(np.testing.assert_allclose, **tol)
    bt = np.asarray(md.block_tables)
    companion = np.asarray(q[run : run + 1])
    in_run = np.asarray(
        _reference(q, k, v, _step(bt, [(0, cached + run, run), (1, 1301, 1)], run + 1, True), kw), np.float32
    )
    for i in range(run):
        pos = cached + i
        alone = _reference(q[i : i + 1], k, v, _step(bt, [(0, pos + 1, 1)], 1, False), kw)
        same(np.asarray(alone, np.float32)[0], in_run[i], err_msg=f"token {i} alone")
        # with the companion first and the token second, padded to a larger bucket
        q2 = jnp.asarray(np.concatenate([companion, np.asarray(q[i : i + 1]), np.zeros_like(companion)]))
        both = _reference(q2, k, v, _step(bt, [(1, 1301, 1), (0, pos + 1, 1)], 3, False), kw)
        same(np.asarray(both, np.float32)[1], in_run[i], err_msg=f"token {i} with a companion")
        same(np.asarray(both, np.float32)[0], in_run[run], err_msg="the companion")
