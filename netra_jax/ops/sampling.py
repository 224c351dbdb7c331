"""On-device token sampling with per-row parameters (bias, penalties, temperature, min-p/top-k/top-p, seed, logprobs).
The host packs a SamplingBatch with numpy; a separately jitted `sample` runs one small compiled variant per key."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from netra_jax.ops import token_mask

MAX_LOGPROBS = 20  # K of top_ids / top_logprobs when any row wants logprobs
GREEDY_EPS = 1e-5  # temperatures below this (or top_k == 1) are greedy
CANDIDATES = 256  # tokens taken by lax.top_k for the top-k / top-p thresholds before any bisection
BIAS_BUCKETS = (0, 16, 128, 1024)  # padded logit_bias entries per row; larger maps round up to a power of two
HIST_BUCKETS = (0, 128, 512, 2048, 8192)  # padded penalty history per row; the last one is the cap
_BLOCK = 256  # vocabulary block of the two-level inverse CDF
_ONE_BITS = 0x3F800000  # float32 bits of 1.0: weights lie in [0, 1]

# Semantics (vLLM-compatible):
# - Order: allowed-token mask (structured output: disallowed -> -inf) -> logit_bias -> repetition penalty (tokens
#   seen in prompt or output: positive logits divided, negative multiplied) -> presence/frequency penalties (output
#   tokens only, OpenAI formula) -> greedy rows take the argmax (lowest index on ties) -> temperature -> min_p ->
#   top_k -> top_p (over the min-p/top-k survivors) -> draw.
#   Filters keep ties at their threshold and always keep the most likely token.
# - Draw: each row brings two uniforms, a pure function of its (seed, step) computed on the host (SplitMix64 in
#   counter mode, vectorised numpy: no device RNG to compile), and takes a two-level inverse CDF (a block of _BLOCK
#   tokens, then a token inside it) over its filtered weights in vocabulary order. A row's token depends only on its
#   own logits, parameters, seed and step: never on the bucket size, its position, its companions or the variant.
# - Logprobs follow vLLM's default ("raw"): log_softmax of the model logits before bias, penalties and temperature.
# - Rows whose processed logits are unusable still get a valid id: +inf -> the first +inf token, all -inf -> 0,
#   NaN -> some id in range.
# - Penalty histories longer than HIST_BUCKETS[-1]: see _history (exact unless a request has more distinct prompt ids
#   plus output ids than the cap; then the most recent ones count).
# Cost: the all-greedy variant is one argmax; sampling adds about one exp pass and a short search. top_k/top_p
# thresholds come from lax.top_k over CANDIDATES tokens; rows with a larger top_k, or a nucleus reaching beyond the
# candidates, get an exact bisection on the float bits of their weights, run only when some row needs it.


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
    """Static part of a batch; one compiled variant per distinct key (and row count S)."""

    all_greedy: bool  # every real row is greedy: one argmax, no draw
    use_filter: bool  # some sampled row has top_k or top_p: candidates + thresholds
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


# ---------------------------------------------------------------------------------------------------- host side
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
    use_filter = False
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
            use_filter |= bool(top_k[i] > 0 or top_p[i] < 1.0)
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
    key = SamplingKey(all_greedy, use_filter and not all_greedy, b, hl, bool((nlp >= 0).any()), allowed is not None)
    return SamplingBatch(arrays, key, nlp)


def variant_keys(logprobs: bool = True) -> list[SamplingKey]:
    """The common variants to compile at warm-up for each row bucket (no bias, no penalties: those compile on use)."""
    lps = (False, True) if logprobs else (False,)
    return [SamplingKey(g, f, 0, 0, lp) for lp in lps for g, f in ((True, False), (False, False), (False, True))]


def dummy_arrays(key: SamplingKey, num_rows: int, vocab_size: int = 0) -> SamplingArrays:
    """Neutral numpy inputs shaped for `key` (for warm-up compiles; `vocab_size` is needed by the mask variant)."""
    s, b, hl = num_rows, key.bias_size, key.hist_size
    z, zi = np.zeros(s, np.float32), np.zeros(s, np.int32)
    return SamplingArrays(
        z, zi, np.ones(s, np.float32), z, np.ones(s, np.float32), z, z, np.zeros((s, 2), np.float32),
        np.full((s, b), -1, np.int32), np.zeros((s, b), np.float32),
        np.full((s, hl), -1, np.int32), np.zeros((s, hl), np.bool_),
        np.full((s, token_mask.num_words(vocab_size)), -1, np.int32) if key.use_mask else None,
    )  # fmt: skip


def warm_up(row_buckets: Sequence[int], vocab_size: int, keys: Sequence[SamplingKey] | None = None) -> int:
    """Compile `sample` for every (row bucket, key); returns the number of variants run."""
    keys = variant_keys() if keys is None else keys
    n = 0
    for s in row_buckets:
        # committed, like the model step's logits, so these are the variants the engine calls
        logits = jax.device_put(jnp.zeros((s, vocab_size), jnp.float32), jax.devices()[0])
        for k in keys:
            jax.block_until_ready(sample(logits, jax.device_put(dummy_arrays(k, s, vocab_size)), key=k))
            n += 1
    return n


# -------------------------------------------------------------------------------------------------- device side
def _process(logits: jax.Array, a: SamplingArrays, key: SamplingKey) -> jax.Array:
    """Allowed-token mask, logit bias, then repetition, then presence/frequency penalties. [S, V] -> [S, V] float32."""
    x = logits.astype(jnp.float32)  # [S, V]
    s, v = x.shape
    if key.use_mask:
        x = token_mask.apply_mask(x, a.allowed)
    rows = jnp.arange(s)[:, None]  # [S, 1]
    if key.bias_size:
        ids = jnp.where((a.bias_ids >= 0) & (a.bias_ids < v), a.bias_ids, v)  # [S, B], v is dropped
        x = x.at[rows, ids].add(a.bias_vals, mode="drop")
    if key.hist_size:
        ids = jnp.where((a.hist_ids >= 0) & (a.hist_ids < v), a.hist_ids, v)  # [S, L]
        seen = jnp.zeros((s, v), jnp.bool_).at[rows, ids].set(True, mode="drop")  # [S, V]
        counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(a.hist_is_output.astype(jnp.float32), mode="drop")
        rp = a.repetition_penalty[:, None]  # [S, 1]
        x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
        x = x - a.frequency_penalty[:, None] * counts - a.presence_penalty[:, None] * (counts > 0)
    return x


def _bisect(pred, lo: jax.Array, hi: jax.Array, iters: int) -> jax.Array:
    """Largest int32 t in [lo, hi] with pred(t) true, for pred monotone (true then false) and pred(lo) true."""

    def body(_, c):
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return lax.fori_loop(0, iters, body, (lo, hi))[0]


def _as_float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)[:, None]  # [S, 1]


def _thresholds(e: jax.Array, a: SamplingArrays, active: jax.Array) -> jax.Array:
    """Weight threshold [S, 1] implementing min_p, top_k, then top_p over e = exp(z - max z) in [0, 1]."""
    s, v = e.shape
    c = min(CANDIDATES, v)
    cand = lax.top_k(e, c)[0]  # [S, C] descending
    k, p = a.top_k, a.top_p  # [S]
    tau_k = jnp.where(k > 0, jnp.take_along_axis(cand, jnp.clip(k - 1, 0, c - 1)[:, None], 1)[:, 0], 0.0)  # [S]
    lo, hi = jnp.zeros(s, jnp.int32), jnp.full(s, _ONE_BITS, jnp.int32)
    need_k = active & (k > c)

    def exact_k():
        bits = _bisect(lambda t: jnp.sum(e >= _as_float(t), -1) >= k, lo, hi, 30)
        return jnp.where(need_k, _as_float(bits)[:, 0], tau_k)

    tau_k = lax.cond(need_k.any(), exact_k, lambda: tau_k)
    tau0 = jnp.maximum(a.min_p, tau_k)[:, None]  # [S, 1]
    target = p * jnp.sum(jnp.where(e >= tau0, e, 0.0), -1)  # [S] top_p share of the surviving mass
    hit = jnp.cumsum(cand, -1) >= target[:, None]  # [S, C]; the survivors are a prefix of cand
    tau_p = jnp.where(p < 1.0, jnp.take_along_axis(cand, jnp.argmax(hit, -1)[:, None], 1)[:, 0], 0.0)  # [S]
    need_p = active & (p < 1.0) & ~hit[:, -1]

    def exact_p():
        mass = lambda t: jnp.sum(jnp.where((e >= _as_float(t)) & (e >= tau0), e, 0.0), -1)
        bits = _bisect(lambda t: mass(t) >= target, lo, hi, 30)
        return jnp.where(need_p, _as_float(bits)[:, 0], tau_p)

    tau_p = lax.cond(need_p.any(), exact_p, lambda: tau_p)
    return jnp.maximum(tau0, tau_p[:, None])


def _weights(x: jax.Array, a: SamplingArrays, key: SamplingKey) -> tuple[jax.Array, jax.Array]:
    """Unnormalised filtered weights [S, V] and the uniforms [S, 2] of the draw. Greedy rows, and rows whose logits
    are unusable (NaN, +inf, all -inf), get weight 1 on the maximal logits and u = 0: the draw is then the argmax."""
    greedy = a.temperature <= 0.0  # [S]
    z = x / jnp.where(greedy, 1.0, a.temperature)[:, None]  # [S, V]
    m = jnp.max(z, -1, keepdims=True)  # [S, 1]
    hot = greedy | ~jnp.isfinite(m[:, 0])  # [S]
    e = jnp.exp(z - m)  # [S, V] in [0, 1], 1 at the max
    tau = _thresholds(e, a, ~hot) if key.use_filter else a.min_p[:, None]
    w = jnp.where(hot[:, None], (z == m).astype(jnp.float32), jnp.where(e >= tau, e, 0.0))
    return w, jnp.where(hot[:, None], 0.0, a.uniforms)


def _search(w: jax.Array, u: jax.Array) -> jax.Array:
    """First positive weight whose cumulative sum exceeds u * total (the last positive one if rounding leaves none).
    w [S, N] >= 0, u [S] -> [S] int32. Zero weights are never chosen, whatever the summation order."""
    c = jnp.cumsum(w, -1)  # [S, N]
    hit = (c > (u * c[:, -1])[:, None]) & (w > 0)  # [S, N]
    last = w.shape[1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, -1), last).astype(jnp.int32)


def _draw(w: jax.Array, u: jax.Array) -> jax.Array:
    """One token per row from weights w [S, V] (positive total), a block first and then a token inside it."""
    s, v = w.shape
    nb = -(-v // _BLOCK)
    wb = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - v))).reshape(s, nb, _BLOCK)  # [S, nb, BLOCK]
    blk = _search(wb.sum(-1), u[:, 0])  # [S]
    inner = jnp.take_along_axis(wb, blk[:, None, None], 1)[:, 0]  # [S, BLOCK]
    return blk * _BLOCK + _search(inner, u[:, 1])


def _argmax(x: jax.Array) -> jax.Array:
    """Lowest index of each row's maximum, [S, V] -> [S] int32 (NaN rows: some index in range). Two plain
    reductions: on CPU several times faster than XLA's variadic (value, index) argmax reduce."""
    v = x.shape[1]
    m = jnp.max(x, -1, keepdims=True)  # [S, 1]
    idx = jnp.min(jnp.where(x == m, jnp.arange(v, dtype=jnp.int32)[None, :], v), -1)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)


def _sample(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> SamplerOutput:
    x = _process(logits, a, key)  # [S, V]
    if key.all_greedy:
        tokens = _argmax(x)  # [S]
    else:
        tokens = jnp.minimum(_draw(*_weights(x, a, key)), x.shape[1] - 1)  # [S], in range even for NaN rows
    if not key.want_logprobs:
        return SamplerOutput(tokens, None, None, None)
    raw = logits.astype(jnp.float32)  # [S, V]
    m = jnp.max(raw, -1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(raw - m), -1, keepdims=True))  # [S, 1]
    lp = jnp.take_along_axis(raw, tokens[:, None], 1)[:, 0] - lse[:, 0]  # [S]
    top_vals, top_ids = lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[1]))  # [S, K]
    return SamplerOutput(tokens, lp, top_ids.astype(jnp.int32), top_vals - lse)


sample_fn = _sample  # un-jitted, for callers that fuse sampling into a larger jitted step
sample = jax.jit(_sample, static_argnames=("key",))


@partial(jax.jit, static_argnames=("key",))
def process_logits(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> jax.Array:
    """The logits after bias and penalties, as greedy rows see them. [S, V] float32."""
    return _process(logits, a, key)


@partial(jax.jit, static_argnames=("key",))
def sampling_probs(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> jax.Array:
    """The distribution each row draws from [S, V] (one-hot for greedy rows); for tests and debugging."""
    x = _process(logits, a, key)
    if key.all_greedy:
        return jax.nn.one_hot(jnp.argmax(x, -1), x.shape[1], dtype=jnp.float32)
    w = _weights(x, a, key)[0]
    return w / jnp.sum(w, -1, keepdims=True)
