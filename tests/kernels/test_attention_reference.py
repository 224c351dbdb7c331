"""The jnp reference's two paths: query blocks (prefill runs) and per-token (decode rows) must agree with each other
and with a dense softmax over every visible key, on mixed ragged batches with windows, soft-caps and padding; so must
the "cpu" backend, whose per-token rows run the C++ kernel (netra_jax/ops/cpu_attention.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import DECODE, MIXED, SINKS, dense, make_case

from netra_jax.ops import cpu_kernels
from netra_jax.ops.attention import BACKENDS, AttentionWork, build_work, num_items

LONG = [(0, 100), (200, 70), (5, 1), (0, 33), (64, 1)]


@pytest.mark.parametrize(
    "seqs,kw,shape",
    [
        (MIXED, {}, dict(G=2, D=64, P=16, KH=2)),
        (MIXED, dict(sliding_window=24), dict(G=4, D=64, P=16, KH=2)),
        (MIXED, dict(sliding_window=9, soft_cap=2.0), dict(G=3, D=80, P=16, KH=3)),
        (LONG, {}, dict(G=3, D=64, P=16, KH=3)),
        (DECODE, {}, dict(G=4, D=64, P=32, KH=1)),
        ([(0, 300)], dict(sliding_window=50), dict(G=2, D=64, P=64, KH=2)),
        (MIXED, dict(sinks=SINKS[:6]), dict(G=3, D=64, P=16, KH=2)),
        (LONG, dict(sinks=SINKS[:4], sliding_window=30, soft_cap=5.0), dict(G=2, D=64, P=16, KH=2)),
        # one or two decode tokens over long contexts: the C++ kernel splits each token's keys in parts and merges them
        ([(1500, 1)], {}, dict(G=3, D=64, P=16, KH=1)),
        ([(2100, 1), (700, 1)], dict(sinks=SINKS[:2], sliding_window=1100, soft_cap=5.0), dict(G=2, D=64, P=16, KH=1)),
    ],
    ids=[
        "mixed",
        "window",
        "window_softcap_gqa3",
        "long_runs",
        "decode",
        "one_long_prompt_window",
        "sinks",
        "sinks_all",
        "decode_long_split",
        "decode_long_split_sinks_window",
    ],
)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_block_and_token_paths_match_dense(seqs, kw, shape, backend):
    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip(f"the C++ kernels are not built: {cpu_kernels.unavailable_reason()}")
    fn = BACKENDS[backend]
    q, k, v, md = make_case(seqs, dtype=jnp.float32, pad_tokens=3, pad_seqs=2, **shape)
    if "sinks" in kw:
        kw = dict(kw, sinks=jnp.asarray(kw["sinks"]))
    T, S = q.shape[0], md.seq_lens.shape[0]
    want = dense(q, k, v, md, scale=0.125, **kw)
    attend = jax.jit(lambda q, k, v, md: fn(q, k, v, md, scale=0.125, **kw))
    per_token = attend(q, k, v, md)  # no work lists: every token per token
    lens = [n for _, n in seqs]
    work = AttentionWork(*(jnp.asarray(a) for a in build_work(lens, T, S)))
    split = attend(q, k, v, md.replace(work=work))
    # speculative verification: every token of the second sequence per token, the rest split as usual
    spec = AttentionWork(*(jnp.asarray(a) for a in build_work(lens, T, S, per_token=[i == 1 for i in range(S)])))
    verify = attend(q, k, v, md.replace(work=spec))
    for got in (per_token, split, verify):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
        assert not np.asarray(got)[int(md.query_start_loc[-1]) :].any(), "padding tokens must give zeros"
    if backend == "cpu":  # the kernel runs: its custom call is in the program
        assert "netra_token_attention_f32" in attend.lower(q, k, v, md).as_text()


def test_cpu_backend_runs_the_reference_for_other_dtypes():
    q, k, v, md = make_case(MIXED, dtype=jnp.bfloat16, pad_tokens=3, pad_seqs=2, G=2, D=64, P=16, KH=2)
    fn = jax.jit(lambda q, k, v, md, b: BACKENDS[b](q, k, v, md, scale=0.125), static_argnums=4)
    assert "netra_token_attention_f32" not in fn.lower(q, k, v, md, "cpu").as_text()
    np.testing.assert_array_equal(np.asarray(fn(q, k, v, md, "cpu")), np.asarray(fn(q, k, v, md, "reference")))


def test_build_work_splits_runs():
    tokens, nt, start, length, seq, ni = build_work([1, 70, 1, 3], num_tokens=80, num_seqs=6)
    assert nt == 2 and list(tokens[:2]) == [0, 71] and (tokens[2:] == 80).all()
    assert ni == 4 and len(start) == num_items(80, 6)
    assert list(start[:4]) == [1, 33, 65, 72] and list(length[:4]) == [32, 32, 6, 3] and list(seq[:4]) == [1, 1, 1, 3]
    assert not length[4:].any()


def test_cpu_kernel_token_result_does_not_depend_on_the_batch():
    """The C++ kernel computes a long-context token's keys in parts (fixed 1024-position chunks) and merges them: a
    token's output is bit for bit the same listed alone as listed with others of other lengths (batch-invariant
    greedy decoding rests on it)."""
    if not cpu_kernels.available():
        pytest.skip(f"the C++ kernels are not built: {cpu_kernels.unavailable_reason()}")
    from netra_jax.ops.cpu_attention import token_attention

    rng = np.random.default_rng(5)
    T, H, KH, D, P, pages = 6, 3, 1, 64, 16, 400
    positions = np.array([2500, 3000, 40, 700, 1100, 5000], np.int32)
    q = jnp.asarray(rng.standard_normal((T, H, D), dtype=np.float32))
    k, v = (jnp.asarray(rng.standard_normal((pages, P, KH, D), dtype=np.float32)) for _ in range(2))
    rows = jnp.asarray(np.stack([rng.permutation(pages) for _ in range(T)]).astype(np.int32))
    valid = jnp.ones((T,), bool)

    def run(listed):
        tokens = jnp.asarray(np.array(listed + [T] * (T - len(listed)), np.int32))
        return np.asarray(
            token_attention(
                q,
                k,
                v,
                tokens,
                jnp.int32(len(listed)),
                jnp.asarray(positions),
                valid,
                rows,
                scale=0.125,
                sliding_window=None,
                soft_cap=None,
                sinks=None,
            )
        )

    together = run(list(range(T)))
    for t in (0, 5, 2):
        alone = run([t])
        np.testing.assert_array_equal(alone[t], together[t])
        assert not np.delete(alone, t, axis=0).any()  # rows not listed: zeros
