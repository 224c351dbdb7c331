"""Tests of the on-device sampler against an independent float64 numpy implementation (sort-based, vLLM semantics):
greedy, filters, penalties, bias, logprobs, draw frequencies, seeding, batch independence and padding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy.stats import chi2
from support.compiles import compiled_jits

from netra_jax.ops import sampling as sm
from netra_jax.ops.sampling import RowSampling as R

S, V = 16, 600  # V > CANDIDATES, not a multiple of the draw block


def logits_for(seed: int, rows: int = S, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)  # [rows, V]


def run(rows, logits, num_rows=None):
    b = sm.build_sampling_batch(rows, num_rows or logits.shape[0], V)
    return sm.sample(logits, jax.device_put(b.arrays), key=b.key), b


def probs(rows, logits):
    b = sm.build_sampling_batch(rows, logits.shape[0], V)
    return np.asarray(sm.sampling_probs(logits, b.arrays, key=b.key))  # [S, V]


# ------------------------------------------------------------------------------------------- numpy reference
def ref_logits(x: np.ndarray, r: R) -> np.ndarray:
    x = x.astype(np.float64).copy()
    for t, b in (r.logit_bias or {}).items():
        x[t] += b
    out = np.bincount(np.asarray(r.output_ids, np.int64), minlength=V).astype(np.float64)
    seen = (out > 0) | (np.bincount(np.asarray(r.prompt_ids, np.int64), minlength=V) > 0)
    pen = np.where(x > 0, x / r.repetition_penalty, x * r.repetition_penalty)
    x = np.where(seen, pen, x)
    return x - r.frequency_penalty * out - r.presence_penalty * (out > 0)


def ref_probs(x: np.ndarray, r: R) -> np.ndarray:
    x = ref_logits(x, r)
    if r.temperature < 1e-5 or r.top_k == 1:
        return np.eye(V)[np.argmax(x)]
    z = x / r.temperature
    p = np.exp(z - z.max())
    keep = p >= r.min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if 0 < r.top_k < V:
        kth = z[order][keep[order]][min(r.top_k, keep.sum()) - 1]
        keep &= z >= kth
    if r.top_p < 1.0:
        q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        excl = np.cumsum(q[order]) - q[order]  # mass strictly before each token, most likely first
        cut = np.zeros(V, bool)
        cut[order] = excl >= r.top_p
        keep &= ~cut
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def chi2_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    support = p > 0
    assert np.isin(tokens, np.flatnonzero(support)).all(), "drew a token outside the filtered support"
    counts = np.bincount(tokens, minlength=V)[support]
    expected = p[support] * tokens.size
    assert support.sum() >= 3 and expected.min() >= 5, "test distribution too narrow for a chi-square test"
    return float(chi2.sf(((counts - expected) ** 2 / expected).sum(), support.sum() - 1))


# ------------------------------------------------------------------------------------------------- greedy
def test_greedy_is_argmax_with_lowest_index_ties():
    x = logits_for(0)
    x[3, 7] = x[3, 40] = x[3].max() + 1.0  # tie: lowest index wins
    rows = [R(temperature=0.0, seed=i) for i in range(S - 2)]  # two padding rows
    out, b = run(rows, x)
    assert b.key.all_greedy and out.logprobs is None
    np.testing.assert_array_equal(np.asarray(out.token_ids)[: S - 2], np.argmax(x, -1)[: S - 2])
    assert int(out.token_ids[3]) == 7


def test_top_k_one_and_greedy_rows_in_a_sampling_batch_equal_argmax():
    x = logits_for(1)
    rows = [R(temperature=1.3, top_k=1, seed=i) if i % 3 else R(temperature=0.0) for i in range(S - 1)]
    rows.append(R(temperature=1.0, top_p=0.5, seed=5))  # forces a sampling variant with filters
    out, b = run(rows, x)
    assert not b.key.all_greedy
    np.testing.assert_array_equal(np.asarray(out.token_ids)[: S - 1], np.argmax(x, -1)[: S - 1])


# ----------------------------------------------------------------------------------- filtered distributions
FILTER_CASES = [
    R(temperature=0.7),
    R(temperature=1.5, min_p=0.1),
    R(temperature=1.0, top_k=5),
    R(temperature=0.9, top_k=300),  # beyond the candidates: exact bisection
    R(temperature=1.0, top_p=0.8),
    R(temperature=3.0, top_p=0.9),  # flat: nucleus beyond the candidates
    R(temperature=1.0, top_k=40, top_p=0.7, min_p=0.02),
    R(temperature=0.5, top_k=0, top_p=0.3),
]


def test_sampling_distribution_matches_reference():
    x = logits_for(2)
    rows = [FILTER_CASES[i % len(FILTER_CASES)] for i in range(S)]
    got = probs(rows, x)
    for i, r in enumerate(rows):
        want = ref_probs(x[i], r)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"support of row {i} ({r})")
        np.testing.assert_allclose(got[i], want, atol=2e-6, rtol=1e-4, err_msg=f"row {i}")
    assert (got[5] > 0).sum() > sm.CANDIDATES and (got[3] > 0).sum() == 300


def test_thresholds_are_exact_on_near_ties():
    # 600 distinct logits 1e-6 apart: thresholds must land on the exact element (bisection on float bits)
    x = np.tile((1.0 + 1e-6 * np.random.default_rng(13).permutation(V)).astype(np.float32), (S, 1))
    cases = [R(top_k=300), R(top_k=100), R(top_p=0.5), R(top_p=0.3, top_k=400), R(min_p=0.9995, top_p=0.9)]
    rows = [cases[i % len(cases)] for i in range(S)]
    got = probs(rows, x)
    for i, r in enumerate(rows[: len(cases)]):
        want = ref_probs(x[i], r)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=str(r))
    assert [(got[i] > 0).sum() for i in range(2)] == [300, 100]


@pytest.mark.parametrize(
    "row, scale",
    [(R(temperature=1.0), 0.0), (R(temperature=0.8, top_k=6), 0.3), (R(temperature=1.0, top_p=0.8, min_p=0.1), 0.3)],
)
def test_draw_frequencies_match_reference(row, scale):
    # support spread over the three draw blocks (ids 0..255, 256..511, 512..599) and their borders
    base = np.full(V, -np.inf, np.float32)
    ids = np.array([0, 3, 200, 255, 256, 257, 400, 511, 512, 513, 580, 599])
    base[ids] = -scale * np.random.default_rng(3).permutation(ids.size)
    x = np.tile(base, (S, 1))
    rows = [R(**{**row.__dict__, "seed": 1000 + i}) for i in range(S)]
    draws = []
    for step in range(128):
        for r in rows:
            r.step = step
        draws.append(np.asarray(run(rows, x)[0].token_ids))
    assert chi2_pvalue(np.concatenate(draws), ref_probs(base, row)) > 1e-4


def test_wide_distribution_frequencies_and_seeds():
    x = np.tile(logits_for(4, 1, 0.3), (S, 1))  # nearly uniform over all V tokens
    tokens = np.stack([np.asarray(run([R(seed=i, step=t) for i in range(S)], x)[0].token_ids) for t in range(64)])
    assert len(np.unique(tokens[0])) >= S - 2  # different seeds, different draws
    assert len(np.unique(tokens[:, 0])) >= 56  # one seed, different steps, different draws
    # bin the 600 tokens into 10 groups and compare frequencies with the reference
    p = ref_probs(x[0], R())
    counts = np.bincount(tokens.ravel() * 10 // V, minlength=10)
    expected = np.add.reduceat(p, np.arange(0, V, V // 10)) * tokens.size
    assert chi2.sf(((counts - expected) ** 2 / expected).sum(), 9) > 1e-4


def test_same_seed_and_step_give_same_token_whatever_the_batch():
    x = logits_for(5, S, 1.0)
    rows = [R(temperature=1.0 + 0.05 * i, min_p=0.01 * (i % 3), seed=77 + i, step=9) for i in range(S)]
    alone, b1 = run(rows, x)
    again, _ = run(rows, x)
    np.testing.assert_array_equal(np.asarray(alone.token_ids), np.asarray(again.token_ids))
    # same rows in reverse order, interleaved with companions that switch on every feature, in a bigger bucket
    companion = R(
        temperature=0.9,
        top_k=30,
        top_p=0.8,
        logit_bias={1: 5.0},
        repetition_penalty=1.3,
        presence_penalty=0.5,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 4],
        num_logprobs=3,
        seed=1,
    )
    mixed, xm = [], np.zeros((2 * S, V), np.float32)
    for j, i in enumerate(reversed(range(S))):
        mixed += [companion, rows[i]]
        xm[2 * j], xm[2 * j + 1] = x[(i + 1) % S], x[i]
    out, b2 = run(mixed, xm, num_rows=2 * S)
    assert b1.key != b2.key and b2.key.want_logprobs and b2.key.hist_size and b2.key.bias_size
    np.testing.assert_array_equal(np.asarray(out.token_ids)[1::2], np.asarray(alone.token_ids)[::-1])
    shifted, _ = run([R(**{**r.__dict__, "step": 10}) for r in rows], x)
    assert (np.asarray(shifted.token_ids) != np.asarray(alone.token_ids)).sum() >= S // 2


# ------------------------------------------------------------------------------------------ bias, penalties
def test_penalties_and_bias_change_logits_exactly_as_reference():
    x = logits_for(6)
    rng = np.random.default_rng(7)
    rows = []
    for i in range(S - 3):
        bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, i)} or None
        r = R(temperature=0.8, logit_bias=bias, prompt_ids=rng.integers(0, V, 40 + 10 * i))
        r.output_ids = list(rng.integers(0, V, 3 * i))
        r.repetition_penalty = float(rng.uniform(0.5, 2.0)) if i % 2 else 1.0
        r.presence_penalty = float(rng.uniform(-2, 2)) if i % 3 else 0.0
        r.frequency_penalty = float(rng.uniform(-2, 2)) if i % 4 else 0.0
        rows.append(r)
    rows.append(R(temperature=0.8, prompt_ids=[1, 2], output_ids=[3]))  # no penalty: history unused
    rows.append(R(logit_bias={V + 5: 50.0, -3: 50.0, 9: float("nan")}))  # invalid entries are dropped
    b = sm.build_sampling_batch(rows, S, V)
    assert b.key.hist_size == 512 and b.key.bias_size == 16
    got = np.asarray(sm.process_logits(x, b.arrays, key=b.key))
    for i, r in enumerate(rows):
        np.testing.assert_allclose(got[i], ref_logits(x[i], r if i < S - 3 else R()), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[S - 3 :], x[S - 3 :])  # rows without penalties or bias: bit-exact


def test_history_beyond_cap_keeps_prompt_set_exactly():
    prompt = np.tile(np.arange(50, 90), 300)  # 12000 ids, 40 distinct: exact after reduction to the set
    r = R(repetition_penalty=1.5, frequency_penalty=0.5, prompt_ids=prompt, output_ids=[3, 3, 50, 599])
    b = sm.build_sampling_batch([r], S, V)
    assert b.key.hist_size == 128  # 40 distinct prompt ids + 4 output ids
    x = logits_for(8)
    np.testing.assert_allclose(
        np.asarray(sm.process_logits(x, b.arrays, key=b.key))[0], ref_logits(x[0], r), rtol=1e-6, atol=1e-6
    )
    ids, n_prompt = sm._history(R(prompt_ids=[1, 2, 1, 3, 2], output_ids=[7, 8, 9, 7]), 6)
    np.testing.assert_array_equal(ids, [3, 2, 7, 8, 9, 7])  # prompt set by last use, then the most recent ids
    assert n_prompt == 2


def test_logit_bias_forces_and_forbids():
    x = logits_for(9)
    top = np.argmax(x, -1)
    rows = [R(temperature=1.5, seed=i, logit_bias={(i * 37) % V: 100.0}) for i in range(S // 2)]
    rows += [R(temperature=0.0, logit_bias={int(top[i]): -100.0}) for i in range(S // 2, S)]
    out = np.asarray(run(rows, x)[0].token_ids)
    np.testing.assert_array_equal(out[: S // 2], [(i * 37) % V for i in range(S // 2)])
    assert (out[S // 2 :] != top[S // 2 :]).all()
    banned = {int(t): -100.0 for t in np.argsort(-x[0])[:5]}
    rows = [R(temperature=2.0, seed=i, logit_bias=banned) for i in range(S)]
    draws = np.concatenate([np.asarray(run(rows, np.tile(x[:1], (S, 1)))[0].token_ids) for _ in range(1)])
    assert len(set(draws.tolist())) > S // 2 and not set(draws.tolist()) & set(banned)


# ----------------------------------------------------------------------------------- logprobs, padding, warm-up
def test_logprobs_are_raw_log_softmax():
    x = logits_for(10)
    rows = [R(temperature=0.0, num_logprobs=5), R(temperature=0.7, seed=3, num_logprobs=0, logit_bias={4: 30.0})]
    out, b = run(rows + [R(temperature=1.0, top_k=10, seed=i) for i in range(S - 2)], x)
    assert b.key.want_logprobs and list(b.num_logprobs[:3]) == [5, 0, -1]
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))  # [S, V]
    tok = np.asarray(out.token_ids)
    assert tok[1] == 4  # biased token drawn, its logprob still the raw one
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(S), tok], rtol=1e-5, atol=1e-5)
    order = np.argsort(-x, -1, kind="stable")[:, : sm.MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)


def test_padding_and_non_finite_rows_return_valid_tokens():
    x = logits_for(11)
    x[0] = np.nan
    x[1, 5] = np.inf
    x[2] = -np.inf
    x[3, 10:] = np.nan  # garbage in a padding row
    rows = [R(temperature=1.0, top_p=0.9, seed=1), R(temperature=0.8, seed=2), R(temperature=0.5, top_k=3), None]
    out, _ = run(rows + [R(temperature=0.0)] * 4, x)  # rows 8.. are padding
    tok = np.asarray(out.token_ids)
    assert ((tok >= 0) & (tok < V)).all()
    assert tok[1] == 5  # the +inf token
    np.testing.assert_array_equal(tok[4:8], np.argmax(x[4:8], -1))


def test_warm_up_covers_the_common_variants():
    # as the engine calls it: logits committed to the device (the model step's output), arrays put per step
    x = jax.device_put(logits_for(12), jax.devices()[0])
    # token programs (greedy, sampled, covering), then the logprob programs (plain, covering)
    assert sm.warm_up([S], V) == len(sm.variant_keys()) + 2 == 5
    with compiled_jits() as compiled:
        for rows in ([R(temperature=0.0)], [R(seed=1, num_logprobs=2)], [R(top_k=20, seed=2)], [R()] * S):
            run(rows, x)
        assert compiled.count("sample_tokens") == compiled.count("token_logprobs") == 0
        run([R(temperature=0.0, logit_bias=dict.fromkeys(range(20), 1.0))], x)  # bias variants: on first use
        assert compiled.count("sample_tokens") == 1


def _packed(allowed: np.ndarray) -> np.ndarray:
    """A [V] bool mask as the packed int32 words llguidance writes."""
    bits = np.zeros(sm.token_mask.num_words(V) * 32, np.uint32)
    bits[:V] = allowed
    return (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(1).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("want_logprobs", [False, True])
def test_the_covering_program_gives_each_variant_its_own_results(want_logprobs):
    """A batch whose own variant was not compiled runs in the covering one (its arrays padded) with the tokens and
    logprobs its own program gives."""
    x = jax.device_put(logits_for(21), jax.devices()[0])
    lk = sm.logprob_key(sm.COVER_KEY)
    arrays = sm.dummy_arrays(sm.COVER_KEY, S, V)
    programs = {
        sm.token_program_key(S, sm.COVER_KEY): sm.sample_tokens.trace(x, arrays, key=sm.COVER_KEY).lower().compile(),
        sm.logprob_program_key(S, lk): sm.token_logprobs.trace(x, x[:, 0].astype(np.int32), arrays, key=lk)
        .lower()
        .compile(),
    }
    mask = np.random.default_rng(3).random(V) < 0.2
    nlp = 3 if want_logprobs else None
    batches = [
        [R(temperature=0.0, logit_bias={7: 40.0, 9: -5.0}, num_logprobs=nlp), R(seed=4)],  # greedy + bias
        [R(seed=5, repetition_penalty=1.3, prompt_ids=[1, 2, 3], output_ids=[4, 4], num_logprobs=nlp)],  # penalties
        [R(temperature=0.0, allowed=_packed(mask)), R(seed=6, top_k=30, allowed=_packed(mask), num_logprobs=nlp)],
        [R(temperature=0.0, num_logprobs=nlp)] * 3,  # a plain variant, not in `programs`: covered too
    ]
    for rows in batches:
        b = sm.build_sampling_batch(rows, S, V)
        assert sm.covers(sm.COVER_KEY, b.key) and b.key != sm.COVER_KEY
        with compiled_jits() as compiled:
            covered = sm.sample(x, b.arrays, key=b.key, programs=programs)
            jax.block_until_ready(covered)
        assert compiled.count("sample_tokens") == compiled.count("token_logprobs") == 0, compiled
        own = sm.sample(x, jax.device_put(b.arrays), key=b.key)
        for got, want in zip(covered, own, strict=True):
            if want is None:
                assert got is None
            else:
                np.testing.assert_array_equal(np.asarray(got)[: len(rows)], np.asarray(want)[: len(rows)])
    assert not sm.covers(sm.COVER_KEY, sm.SamplingKey(False, 2048, 0, False))  # a wider bias than any bucket
