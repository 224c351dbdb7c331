"""The sampler's allowed-token mask variant (packed int32 bits, llguidance's layout): masked rows only ever get
allowed tokens and draw from the reference distribution renormalised over them; rows without a mask are untouched."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from test_sampling import V, ref_probs

from netra_jax.ops import sampling as sm
from netra_jax.ops import token_mask
from netra_jax.ops.sampling import RowSampling as R

S = 4  # V = 600 is not a multiple of 32: the last word is partly padding


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [n] -> int32 words, bit j of word i = token 32 i + j."""
    bits = np.zeros(token_mask.num_words(allowed.size) * 32, np.uint8)
    bits[: allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def masked_ref(x: np.ndarray, allowed: np.ndarray, r: R) -> np.ndarray:
    return ref_probs(np.where(allowed, x, -np.inf), r)


def test_pack_layout_matches_apply_mask():
    rng = np.random.default_rng(0)
    allowed = rng.random((S, V)) < 0.3
    words = np.stack([pack(a) for a in allowed])
    assert words.shape == (S, 19) and words.dtype == np.int32
    x = rng.standard_normal((S, V)).astype(np.float32)
    out = np.asarray(token_mask.apply_mask(x, words))
    np.testing.assert_array_equal(np.isfinite(out), allowed)
    np.testing.assert_array_equal(out[allowed], x[allowed])
    stacked = token_mask.stack_masks([words[0], None, words[2][:3]], S, V)
    assert (stacked[1] == -1).all() and (stacked[3] == -1).all()  # no mask, padding row: everything allowed
    assert (stacked[2, :3] == words[2, :3]).all() and (stacked[2, 3:] == 0).all()  # short mask: the tail is off
    assert token_mask.stack_masks([None, None], S, V) is None


def test_masked_rows_sample_only_allowed_tokens_and_others_are_unchanged():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    allowed = rng.random((2, V)) < 0.05
    allowed[:, 7] = True  # at least one allowed token per row
    rows = [
        R(temperature=0.0),
        R(temperature=1.0, top_k=40, top_p=0.9, seed=3),
        R(temperature=0.0),
        R(temperature=0.8, min_p=0.05, seed=5),
    ]
    m0, m1 = pack(allowed[0]), pack(allowed[1])
    masked = [replace(rows[0], allowed=m0), rows[1], replace(rows[2], allowed=m0), replace(rows[3], allowed=m1)]
    plain = sm.build_sampling_batch(rows, S, V)
    b = sm.build_sampling_batch(masked, S, V)
    assert b.key.use_mask and not plain.key.use_mask and plain.arrays.allowed is None
    p = np.asarray(sm.sampling_probs(x, b.arrays, key=b.key))
    np.testing.assert_allclose(p[0], masked_ref(x[0], allowed[0], rows[0]), atol=1e-6)
    np.testing.assert_allclose(p[2], masked_ref(x[2], allowed[0], rows[2]), atol=1e-6)
    np.testing.assert_allclose(p[3], masked_ref(x[3], allowed[1], rows[3]), atol=1e-5)
    assert p[0].argmax() != x[0].argmax()  # the mask moved the greedy choice
    p_plain = np.asarray(sm.sampling_probs(x, plain.arrays, key=plain.key))
    np.testing.assert_array_equal(p[1], p_plain[1])  # the unmasked row's distribution is bit-identical
    for seed in range(8):
        rs = [replace(r, seed=seed) for r in masked]
        ps = [replace(r, seed=seed) for r in rows]
        bm, bp = sm.build_sampling_batch(rs, S, V), sm.build_sampling_batch(ps, S, V)
        tm = np.asarray(sm.sample(x, jax.device_put(bm.arrays), key=bm.key).token_ids)
        tp = np.asarray(sm.sample(x, jax.device_put(bp.arrays), key=bp.key).token_ids)
        assert allowed[0][tm[0]] and allowed[0][tm[2]] and allowed[1][tm[3]]
        assert tm[1] == tp[1]


def test_all_greedy_mask_variant_and_logprobs_stay_raw():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((S, V)).astype(np.float32)
    only = np.zeros(V, bool)
    only[[5, V - 1]] = True  # the last id lives in the partly used last word
    rows = [R(temperature=0.0, allowed=pack(only), num_logprobs=2), R(temperature=0.0), None, None]
    b = sm.build_sampling_batch(rows, S, V)
    assert b.key.all_greedy and b.key.use_mask and b.key.want_logprobs
    out = sm.sample(x, jax.device_put(b.arrays), key=b.key)
    tok = np.asarray(out.token_ids)
    assert tok[0] == (5 if x[0, 5] >= x[0, V - 1] else V - 1) and tok[1] == x[1].argmax()
    raw = x[0].astype(np.float64) - np.log(np.exp(x[0].astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], raw[tok[0]], atol=1e-5)
