"""On-device token sampling with per-row parameters (bias, penalties, temperature, min-p/top-k/top-p, seed, logprobs).
The host packs a SamplingBatch with numpy; `sample` runs a small jitted token program per key and, when a row wants
logprobs, a logprob program per row count."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from netra_jax.ops import token_mask
from netra_jax.ops.invariant import tree_sum
from netra_jax.ops.sampling_batch import (  # noqa: F401 (re-exported: callers use sampling.<name>)
    BIAS_BUCKETS,
    COVER_KEY,
    GREEDY_EPS,
    HIST_BUCKETS,
    MAX_LOGPROBS,
    RowSampling,
    SamplerOutput,
    SamplingArrays,
    SamplingBatch,
    SamplingKey,
    _history,
    build_sampling_batch,
    covers,
    dummy_arrays,
    pad_to,
    row_uniforms,
    variant_keys,
)

CANDIDATES = 256  # tokens taken by lax.top_k for the top-k / top-p thresholds before any bisection
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
# - Logprobs follow vLLM's default ("raw"): log_softmax of the model logits before bias, penalties and temperature;
#   the sampled token's also under the processed distribution it was drawn from (vLLM's "processed_logprobs").
#   Their sums, and the top-p mass, run in a fixed order (`ops.invariant.tree_sum`): a row's values do not depend
#   on the rows beside it.
# - Rows whose processed logits are unusable still get a valid id: +inf -> the first +inf token, all -inf -> 0,
#   NaN -> some id in range.
# - Penalty histories longer than HIST_BUCKETS[-1]: see _history (exact unless a request has more distinct prompt ids
#   plus output ids than the cap; then the most recent ones count).
# Cost: the all-greedy variant is one argmax; sampling adds about one exp pass and a short search. top_k/top_p
# thresholds come from lax.top_k over CANDIDATES tokens, computed only when some row of the batch has a top_k or top_p
# (a branch on device, so one compiled variant serves batches with and without them); rows with a larger top_k, or a
# nucleus reaching beyond the candidates, get an exact bisection on the float bits of their weights, run only when
# some row needs it. Logprobs are a program of their own (`token_logprobs`), so no token variant is compiled twice.


def example_inputs(num_rows: int, vocab_size: int, compile_for: jax.Device | None = None) -> tuple[jax.Array, ...]:
    """Zero logits [R, vocab] float32 and token ids [R] int32 as the engine passes them to the sampler's programs:
    committed to the device (a step's output and a token program's output), so programs compiled on them are the
    ones the engine calls. compile_for: a compile-only device (a GPU target's): ShapeDtypeStructs placed on it."""
    if compile_for is not None:
        on = jax.sharding.SingleDeviceSharding(compile_for)
        logits = jax.ShapeDtypeStruct((num_rows, vocab_size), jnp.float32, sharding=on)
        return logits, jax.ShapeDtypeStruct((num_rows,), jnp.int32, sharding=on)
    dev = jax.devices()[0]
    logits = jax.device_put(np.zeros((num_rows, vocab_size), np.float32), dev)  # [R, vocab]
    tokens = jax.device_put(np.zeros(num_rows, np.int32), dev)  # [R]
    return logits, tokens


def token_program_key(num_rows: int, key: SamplingKey) -> tuple:
    """The token program `sample` calls for `num_rows` rows under `key`, as a key of a table of programs compiled
    ahead of time (`netra_jax.engine.bundle`)."""
    return ("sample_tokens", num_rows, key._replace(want_logprobs=False))


def logprob_program_key(num_rows: int, key: SamplingKey) -> tuple:
    """The logprob program `sample` calls for `num_rows` rows under `key` (see `token_program_key`)."""
    return ("token_logprobs", num_rows, logprob_key(key))


def logprob_keys(keys: Sequence[SamplingKey]) -> list[SamplingKey]:
    """The logprob programs that go with token programs `keys` (one per processing variant, `logprob_key`)."""
    return list(dict.fromkeys(logprob_key(k) for k in keys))


def warm_up(row_buckets: Sequence[int], vocab_size: int, keys: Sequence[SamplingKey] | None = None) -> int:
    """Compile the token program for every (row bucket, key) and the logprob programs of those keys for every row
    bucket; returns the number of programs run."""
    keys = variant_keys() if keys is None else keys
    n = 0
    for s in row_buckets:
        logits, tokens = example_inputs(s, vocab_size)
        for k in keys:
            jax.block_until_ready(sample(logits, jax.device_put(dummy_arrays(k, s, vocab_size)), key=k))
            n += 1
        for lk in logprob_keys(keys):
            arrays = jax.device_put(dummy_arrays(lk, s, vocab_size))
            jax.block_until_ready(token_logprobs(logits, tokens, arrays, key=lk))
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


def _argmax(x: jax.Array) -> jax.Array:
    """Lowest index of each row's maximum (the first True for bools), [S, V] -> [S] int32; NaN rows: some index in
    range. Two plain reductions: on CPU several times faster than XLA's variadic (value, index) argmax reduce."""
    v = x.shape[1]
    m = jnp.max(x, -1, keepdims=True)  # [S, 1]
    idx = jnp.min(jnp.where(x == m, jnp.arange(v, dtype=jnp.int32)[None, :], v), -1)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)


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
    target = p * tree_sum(jnp.where(e >= tau0, e, 0.0))  # [S] top_p share of the surviving mass (fixed order)
    hit = jnp.cumsum(cand, -1) >= target[:, None]  # [S, C]; the survivors are a prefix of cand
    tau_p = jnp.where(p < 1.0, jnp.take_along_axis(cand, _argmax(hit)[:, None], 1)[:, 0], 0.0)  # [S]
    need_p = active & (p < 1.0) & ~hit[:, -1]

    def exact_p():
        mass = lambda t: tree_sum(jnp.where((e >= _as_float(t)) & (e >= tau0), e, 0.0))
        bits = _bisect(lambda t: mass(t) >= target, lo, hi, 30)
        return jnp.where(need_p, _as_float(bits)[:, 0], tau_p)

    tau_p = lax.cond(need_p.any(), exact_p, lambda: tau_p)
    return jnp.maximum(tau0, tau_p[:, None])


def _weights(x: jax.Array, a: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Unnormalised filtered weights [S, V] and the uniforms [S, 2] of the draw. Greedy rows, and rows whose logits
    are unusable (NaN, +inf, all -inf), get weight 1 on the maximal logits and u = 0: the draw is then the argmax.
    The top-k/top-p thresholds are computed only when some drawing row has a top_k or top_p (for a row without them
    they equal its min_p)."""
    greedy = a.temperature <= 0.0  # [S]
    z = x / jnp.where(greedy, 1.0, a.temperature)[:, None]  # [S, V]
    m = jnp.max(z, -1, keepdims=True)  # [S, 1]
    hot = greedy | ~jnp.isfinite(m[:, 0])  # [S]
    e = jnp.exp(z - m)  # [S, V] in [0, 1], 1 at the max
    filtered = ~hot & ((a.top_k > 0) | (a.top_p < 1.0))  # [S]
    tau = lax.cond(filtered.any(), lambda: _thresholds(e, a, ~hot), lambda: a.min_p[:, None])  # [S, 1]
    w = jnp.where(hot[:, None], (z == m).astype(jnp.float32), jnp.where(e >= tau, e, 0.0))
    return w, jnp.where(hot[:, None], 0.0, a.uniforms)


def _search(w: jax.Array, u: jax.Array) -> jax.Array:
    """First positive weight whose cumulative sum exceeds u * total (the last positive one if rounding leaves none).
    w [S, N] >= 0, u [S] -> [S] int32. Zero weights are never chosen, whatever the summation order."""
    c = jnp.cumsum(w, -1)  # [S, N]
    hit = (c > (u * c[:, -1])[:, None]) & (w > 0)  # [S, N]
    last = w.shape[1] - 1 - _argmax(w[:, ::-1] > 0)
    return jnp.where(hit.any(-1), _argmax(hit), last)


def _draw(w: jax.Array, u: jax.Array) -> jax.Array:
    """One token per row from weights w [S, V] (positive total), a block first and then a token inside it."""
    s, v = w.shape
    nb = -(-v // _BLOCK)
    wb = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - v))).reshape(s, nb, _BLOCK)  # [S, nb, BLOCK]
    blk = _search(tree_sum(wb), u[:, 0])  # [S] (block masses summed in a fixed order)
    inner = jnp.take_along_axis(wb, blk[:, None, None], 1)[:, 0]  # [S, BLOCK]
    return blk * _BLOCK + _search(inner, u[:, 1])


@partial(jax.jit, static_argnames=("key",))
def sample_tokens(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> jax.Array:
    """One token per row [S] int32 from logits [S, V]. Compiled per key (without `want_logprobs`) and row count."""
    x = _process(logits, a, key)  # [S, V]
    if key.all_greedy:
        return _argmax(x)  # [S]
    return jnp.minimum(_draw(*_weights(x, a)), x.shape[1] - 1)  # [S], in range even for NaN rows


def _raw_lse(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The model logits in float32 [S, V] and their log-sum-exp [S, 1], summed in a fixed order."""
    raw = logits.astype(jnp.float32)  # [S, V]
    m = lax.stop_gradient(jnp.max(raw, -1, keepdims=True))  # [S, 1]
    return raw, m + jnp.log(tree_sum(jnp.exp(raw - m)))[:, None]


def _processed_logprobs(x: jax.Array, tokens: jax.Array, a: SamplingArrays) -> jax.Array:
    """Each row's token's log-probability [S] under the distribution the row draws from: the processed logits x
    [S, V] (`_process`) over the temperature, renormalised over the min-p / top-k / top-p survivors (-inf for a token
    outside them), as `_weights` filters them. Greedy rows: the log-softmax of x itself (vLLM's processed logprobs at
    temperature 1, no filter). The filter is held constant under differentiation."""
    greedy = a.temperature <= 0.0  # [S]
    z = x / jnp.where(greedy, 1.0, a.temperature)[:, None]  # [S, V]
    m = lax.stop_gradient(jnp.max(z, -1, keepdims=True))  # [S, 1]
    hot = greedy | ~jnp.isfinite(m[:, 0])  # [S]
    e = jnp.exp(z - m)  # [S, V], as `_weights` computes it
    held = lax.stop_gradient(e)
    filtered = ~hot & ((a.top_k > 0) | (a.top_p < 1.0))  # [S]
    tau = lax.cond(filtered.any(), lambda: _thresholds(held, a, ~hot), lambda: a.min_p[:, None])  # [S, 1]
    keep = hot[:, None] | (held >= tau)  # [S, V] the survivors
    lse = jnp.log(tree_sum(jnp.where(keep, e, 0.0)))  # [S]
    lp = jnp.take_along_axis(z - m, tokens[:, None], 1)[:, 0] - lse
    return jnp.where(jnp.take_along_axis(keep, tokens[:, None], 1)[:, 0], lp, -jnp.inf)


def sampled_logprobs(
    logits: jax.Array, tokens: jax.Array, a: SamplingArrays, *, key: SamplingKey
) -> tuple[jax.Array, jax.Array]:
    """The log-probabilities of tokens [S] under each row's raw distribution (log_softmax of the model logits [S, V],
    vLLM's default logprobs) and its processed one (after mask, bias and penalties, temperature, min-p, top-k and
    top-p: what the row was drawn from, vLLM's "processed_logprobs"), [S] float32 each. Its sums run in a fixed
    order, so a row's values never depend on the other rows or the program it is traced in: the engine's logprob
    program and `netra_jax.rl.sequence_logprobs` give the same bits. Differentiable in logits."""
    raw, lse = _raw_lse(logits)
    lp = jnp.take_along_axis(raw, tokens[:, None], 1)[:, 0] - lse[:, 0]  # [S]
    return lp, _processed_logprobs(_process(logits, a, key), tokens, a)


@partial(jax.jit, static_argnames=("key",))
def token_logprobs(
    logits: jax.Array, tokens: jax.Array, a: SamplingArrays, *, key: SamplingKey
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The sampled tokens' raw and processed logprobs [S] (`sampled_logprobs`), and the top MAX_LOGPROBS ids [S, K]
    and raw logprobs [S, K] (vLLM's default: log_softmax of the model logits, before bias, penalties and
    temperature). Compiled per row count and per key less `all_greedy` and `want_logprobs` (`logprob_key`)."""
    lp, processed = sampled_logprobs(logits, tokens, a, key=key)
    raw, lse = _raw_lse(logits)
    top_vals, top_ids = lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[1]))  # [S, K]
    return lp, processed, top_ids.astype(jnp.int32), top_vals - lse


def logprob_key(key: SamplingKey) -> SamplingKey:
    """The key the logprob program compiles for: only the processing's variant (bias, penalties, mask) matters."""
    return key._replace(all_greedy=False, want_logprobs=True)


def sample(
    logits: jax.Array, a: SamplingArrays, *, key: SamplingKey, programs: Mapping[tuple, Callable] | None = None
) -> SamplerOutput:
    """Sample a batch: the token program of `key`, then the logprob program when `key.want_logprobs` (both dispatched
    asynchronously). logits: [S, V]; `a`: device or numpy arrays (numpy ones are moved by the call, once).
    programs: executables compiled ahead of time by `token_program_key` / `logprob_program_key`, run instead of
    the jitted functions when they hold the key (which compile on a miss). When they hold the covering variant
    (`COVER_KEY`) but not the key's own, numpy arrays are padded to it and it runs instead (the same results)."""
    rows = logits.shape[0]
    if programs and token_program_key(rows, key) not in programs and covers(COVER_KEY, key):
        if token_program_key(rows, COVER_KEY) in programs and isinstance(a.temperature, np.ndarray):
            a = pad_to(a, COVER_KEY, logits.shape[1])
            key = COVER_KEY._replace(want_logprobs=key.want_logprobs)
    if key.want_logprobs:
        a = jax.device_put(a)  # read by both programs
    token_key = key._replace(want_logprobs=False)
    exe = programs.get(token_program_key(rows, key)) if programs else None
    tokens = sample_tokens(logits, a, key=token_key) if exe is None else exe(logits, a)  # [S]
    if not key.want_logprobs:
        return SamplerOutput(tokens, None, None, None)
    exe = programs.get(logprob_program_key(rows, key)) if programs else None
    if exe is None:
        lp, processed, top_ids, top_lps = token_logprobs(logits, tokens, a, key=logprob_key(key))
    else:
        lp, processed, top_ids, top_lps = exe(logits, tokens, a)
    return SamplerOutput(tokens, lp, top_ids, top_lps, processed)


@partial(jax.jit, static_argnames=("key",))
def process_logits(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> jax.Array:
    """The logits after bias and penalties, as greedy rows see them. [S, V] float32."""
    return _process(logits, a, key)


@partial(jax.jit, static_argnames=("key",))
def sampling_probs(logits: jax.Array, a: SamplingArrays, *, key: SamplingKey) -> jax.Array:
    """The distribution each row draws from [S, V] (one-hot for greedy rows); for tests and debugging."""
    x = _process(logits, a, key)
    if key.all_greedy:
        return jax.nn.one_hot(_argmax(x), x.shape[1], dtype=jnp.float32)
    w = _weights(x, a)[0]
    return w / jnp.sum(w, -1, keepdims=True)
