"""Host side of sampling: the per-row parameters (RowSampling), the static variant key and the padded numpy arrays
of a step (SamplingBatch), each row's random draw (SplitMix64), and the neutral inputs used to compile variants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import flax.struct
import jax
import numpy as np

from netra_jax.ops import token_mask

MAX_LOGPROBS = 20  # K of top_ids / top_logprobs when any row wants logprobs
GREEDY_EPS = 1e-5  # temperatures below this (or top_k == 1) are greedy
BIAS_BUCKETS = (0, 16, 128, 1024)  # padded logit_bias entries per row; larger maps round up to a power of two
HIST_BUCKETS = (0, 128, 512, 2048, 8192)  # padded penalty history per row; the last one is the cap


@dataclass
class RowSampling:
    """Sampling parameters of one scheduled row. `step` is the index of the token being generated for the request
    (0 for the first output token) and, with `seed`, fixes the row's random draw. `num_logprobs`: None = no logprobs,
    0 = only the sampled token's, k = also the top k (at most MAX_LOGPROBS). Penalty histories: only the set of
    prompt ids matters, output ids are counted; both are read only when a penalty is active."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int = 0
    step: int = 0
    num_logprobs: int | None = None
    prompt_ids: Sequence[int] | np.ndarray = field(default=())
    output_ids: Sequence[int] | np.ndarray = field(default=())
    allowed: np.ndarray | None = None  # packed int32 bits of the allowed tokens (token_mask layout); None: all

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SamplingKey(NamedTuple):
    """Static part of a batch. The token program compiles once per distinct key less `want_logprobs` (and row count
    S); logprobs are a second program, one per row count and processing variant (bias, penalties, mask), run only
    when some row wants them."""

    all_greedy: bool  # every real row is greedy: one argmax, no draw
    bias_size: int  # B, from BIAS_BUCKETS (0: no row has a logit_bias)
    hist_size: int  # L, from HIST_BUCKETS (0: no row has an active penalty)
    want_logprobs: bool  # some row wants logprobs: compute raw logprobs and the top MAX_LOGPROBS
    use_mask: bool = False  # some row has an allowed-token mask (structured output)


@flax.struct.dataclass
class SamplingArrays:
    """Per-row device inputs, S rows (padding rows: temperature 1, no filter, bias or penalty)."""

    temperature: jax.Array  # [S] float32, 0 for greedy rows
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32, 1 = off
    min_p: jax.Array  # [S] float32, 0 = off
    repetition_penalty: jax.Array  # [S] float32
    presence_penalty: jax.Array  # [S] float32
    frequency_penalty: jax.Array  # [S] float32
    uniforms: jax.Array  # [S, 2] float32 in [0, 1): the row's draw, from row_uniforms(seed, step)
    bias_ids: jax.Array  # [S, B] int32, -1 pad
    bias_vals: jax.Array  # [S, B] float32, 0 pad
    hist_ids: jax.Array  # [S, L] int32 prompt then output ids, -1 pad
    hist_is_output: jax.Array  # [S, L] bool, True for output ids (counted by presence/frequency penalties)
    allowed: jax.Array | None = None  # [S, ceil(V / 32)] int32 packed allowed tokens; None unless key.use_mask


@dataclass
class SamplingBatch:
    arrays: SamplingArrays  # numpy leaves; one device_put moves them all
    key: SamplingKey
    num_logprobs: np.ndarray  # [S] int32, -1 = none (host-side slicing of the output)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [S] int32
    logprobs: jax.Array | None  # [S] float32 raw logprob of the sampled token; None unless key.want_logprobs
    top_ids: jax.Array | None  # [S, MAX_LOGPROBS] int32, most likely first; None unless key.want_logprobs
    top_logprobs: jax.Array | None  # [S, MAX_LOGPROBS] float32
    processed_logprobs: jax.Array | None = None  # [S] float32 the sampled token's under the processed distribution


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return 1 << (n - 1).bit_length()


def _history(row: RowSampling, cap: int) -> tuple[np.ndarray, int]:
    """Token ids for the penalties (prompt ids, then output ids) and how many of them are prompt ids.

    Beyond `cap` ids the prompt is first reduced to its distinct ids, ordered by last occurrence (exact: only the set
    of prompt ids matters); if still too long, the most recent `cap` ids of prompt-set + output are kept.
    """
    p = np.asarray(row.prompt_ids, dtype=np.int32).reshape(-1)
    o = np.asarray(row.output_ids, dtype=np.int32).reshape(-1)
    if p.size + o.size > cap:
        _, first_in_rev = np.unique(p[::-1], return_index=True)
        p = p[np.sort(p.size - 1 - first_in_rev)]
        if p.size + o.size > cap:
            o = o[-cap:]
            p = p[p.size - (cap - o.size) :]
    return np.concatenate([p, o]), p.size


_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_uniforms(seed: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Two uniforms in [0, 1) per row [S, 2] float32 (24-bit): outputs 2*step and 2*step + 1 of the SplitMix64 stream
    of the (pre-mixed) 64-bit seed. seed, step: [S] uint64."""
    ctr = step.astype(np.uint64)[:, None] * np.uint64(2) + np.arange(1, 3, dtype=np.uint64)  # [S, 2]
    h = _mix64(_mix64(seed.astype(np.uint64))[:, None] + ctr * _GAMMA)  # [S, 2]
    return (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def build_sampling_batch(rows: Sequence[RowSampling | None], num_rows: int, vocab_size: int) -> SamplingBatch:
    """Pack per-row parameters into padded numpy arrays; rows beyond len(rows), and None rows, are padding.

    Out-of-vocabulary bias or history ids and NaN bias values are dropped; top_k >= vocab_size means off.
    """
    s = num_rows
    if len(rows) > s:
        raise ValueError(f"{len(rows)} rows do not fit in {s}")
    temp = np.ones(s, np.float32)  # padding rows draw (cheaper than a forced argmax) and are discarded
    real = np.zeros(s, np.bool_)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    rep = np.ones(s, np.float32)
    pres = np.zeros(s, np.float32)
    freq = np.zeros(s, np.float32)
    seed = np.zeros(s, np.uint64)
    step = np.zeros(s, np.uint64)
    nlp = np.full(s, -1, np.int32)
    biases: list[tuple[int, np.ndarray, np.ndarray]] = []
    hists: list[tuple[int, np.ndarray, int]] = []
    for i, r in enumerate(rows):
        if r is None:
            continue
        real[i] = True
        seed[i] = r.seed & 0xFFFFFFFFFFFFFFFF
        step[i] = r.step & 0xFFFFFFFFFFFFFFFF
        if r.num_logprobs is not None and r.num_logprobs >= 0:
            nlp[i] = min(r.num_logprobs, MAX_LOGPROBS)
        if r.greedy:
            temp[i] = 0.0
        else:
            temp[i] = r.temperature
            top_k[i] = r.top_k if 0 < r.top_k < vocab_size else 0
            top_p[i] = min(max(r.top_p, 0.0), 1.0)
            min_p[i] = min(max(r.min_p, 0.0), 1.0)
        if r.logit_bias:
            ids = np.fromiter(r.logit_bias.keys(), np.int64, len(r.logit_bias))
            vals = np.fromiter(r.logit_bias.values(), np.float64, len(r.logit_bias))
            ok = (ids >= 0) & (ids < vocab_size) & ~np.isnan(vals)
            if ok.any():
                biases.append((i, ids[ok].astype(np.int32), vals[ok].astype(np.float32)))
        if r.uses_penalties:
            rep[i], pres[i], freq[i] = r.repetition_penalty, r.presence_penalty, r.frequency_penalty
            ids, n_prompt = _history(r, HIST_BUCKETS[-1])
            hists.append((i, ids, n_prompt))
    b = _bucket(max((x[1].size for x in biases), default=0), BIAS_BUCKETS)
    bias_ids = np.full((s, b), -1, np.int32)
    bias_vals = np.zeros((s, b), np.float32)
    for i, ids, vals in biases:
        bias_ids[i, : ids.size], bias_vals[i, : ids.size] = ids, vals
    n_hist = max((x[1].size for x in hists), default=0)
    hl = _bucket(n_hist, HIST_BUCKETS) if hists else 0
    hist_ids = np.full((s, hl), -1, np.int32)
    hist_out = np.zeros((s, hl), np.bool_)
    for i, ids, n_prompt in hists:
        hist_ids[i, : ids.size] = np.where((ids >= 0) & (ids < vocab_size), ids, -1)
        hist_out[i, n_prompt : ids.size] = True
    uniforms = row_uniforms(seed, step)  # [S, 2]
    allowed = token_mask.stack_masks([r.allowed if r is not None else None for r in rows], s, vocab_size)
    arrays = SamplingArrays(
        temp, top_k, top_p, min_p, rep, pres, freq, uniforms, bias_ids, bias_vals, hist_ids, hist_out, allowed
    )
    all_greedy = not bool((temp[real] > 0).any())
    key = SamplingKey(all_greedy, b, hl, bool((nlp >= 0).any()), allowed is not None)
    return SamplingBatch(arrays, key, nlp)


def variant_keys() -> list[SamplingKey]:
    """The token programs to compile at warm-up for each row bucket: all-greedy and sampled (top-k/top-p are decided
    on device), and the covering one (`COVER_KEY`) that serves every batch with a bias, penalty or grammar mask."""
    return [SamplingKey(True, 0, 0, False), SamplingKey(False, 0, 0, False), COVER_KEY]


# The variant that serves every key it covers (`covers`): sampled (greedy rows take the argmax in it as well), the
# largest bias and penalty-history widths and the grammar mask. A batch whose own variant is not compiled runs in it
# with its arrays padded (`pad_to`): the same tokens and logprobs, at the cost of the widest processing.
COVER_KEY = SamplingKey(False, BIAS_BUCKETS[-1], HIST_BUCKETS[-1], False, True)


def covers(cover: SamplingKey, key: SamplingKey) -> bool:
    """Whether `cover`'s program computes what `key`'s does once the arrays are padded to it (`pad_to`)."""
    return (
        (key.all_greedy or not cover.all_greedy)
        and key.bias_size <= cover.bias_size
        and key.hist_size <= cover.hist_size
        and (cover.use_mask or not key.use_mask)
    )


def pad_to(a: SamplingArrays, cover: SamplingKey, vocab_size: int) -> SamplingArrays:
    """Numpy arrays of a batch laid out for the program of `cover` (`covers(cover, key)`): bias and history columns
    padded with the neutral entries (-1 ids, 0 values, not output), and an all-allowed mask for a batch without one."""
    s = a.temperature.shape[0]

    def cols(x: np.ndarray, width: int, fill) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill)

    allowed = a.allowed
    if cover.use_mask and allowed is None:
        allowed = np.full((s, token_mask.num_words(vocab_size)), -1, np.int32)
    return a.replace(
        bias_ids=cols(a.bias_ids, cover.bias_size, -1),
        bias_vals=cols(a.bias_vals, cover.bias_size, 0.0),
        hist_ids=cols(a.hist_ids, cover.hist_size, -1),
        hist_is_output=cols(a.hist_is_output, cover.hist_size, False),
        allowed=allowed,
    )


def dummy_arrays(key: SamplingKey, num_rows: int, vocab_size: int = 0) -> SamplingArrays:
    """Neutral numpy inputs shaped for `key` (for warm-up compiles; `vocab_size` is needed by the mask variant)."""
    s, b, hl = num_rows, key.bias_size, key.hist_size
    z, zi = np.zeros(s, np.float32), np.zeros(s, np.int32)
    return SamplingArrays(
        z,
        zi,
        np.ones(s, np.float32),
        z,
        np.ones(s, np.float32),
        z,
        z,
        np.zeros((s, 2), np.float32),
        np.full((s, b), -1, np.int32),
        np.zeros((s, b), np.float32),
        np.full((s, hl), -1, np.int32),
        np.zeros((s, hl), np.bool_),
        np.full((s, token_mask.num_words(vocab_size)), -1, np.int32) if key.use_mask else None,
    )
