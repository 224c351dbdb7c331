"""Token buckets: the padded step sizes compiled at warm-up, and the rule that keeps a step from spilling a few tokens
past one. Host only (no jax): the runner pads to the buckets, the scheduler cuts prompt chunks to fit them."""

from __future__ import annotations

import bisect
import functools

__all__ = ["ACCELERATOR_SMALLEST_BUCKET", "bucket_of", "fit_chunk", "token_buckets"]


# The smallest step bucket on an accelerator. A step there is bound by reading the weights until its tokens' matmuls
# take as long: about peak flops / bandwidth / (2 flops per weight per token) * bytes per weight tokens, 150-300 on an
# H100 or H200 for 1- and 2-byte weights (990 TFLOP/s, 3.35-4.8 TB/s), so padding a step up to 64 tokens costs a
# fraction of its weight reads and the buckets below 64 would only add programs (six fewer step programs, and their
# samplers, at 512 sequences). On a CPU a step costs in proportion to its tokens from a few tokens up (2-core EPYC,
# SmolLM2-135M Q4_1: decode of 1 / 4 / 16 / 64 sequences 14 / 20 / 55 / 158 ms, results/2026-12-07-program_costs.json),
# so CPU buckets start at 1.
ACCELERATOR_SMALLEST_BUCKET = 64


@functools.cache
def token_buckets(max_tokens: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` (a power of two) up to the first one covering `max_tokens`, with 1.5x steps
    between them from 512 on (prefill steps are large: this caps their padding at a third instead of a half); the last
    capped to `max_tokens`."""
    out, b = [], min(smallest, 1 << max(max_tokens - 1, 0).bit_length())
    while b < max_tokens:
        out.append(b)
        if b >= 512 and b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_tokens)
    return tuple(out)


def bucket_of(buckets: tuple[int, ...], num_tokens: int) -> int | None:
    """The smallest bucket holding `num_tokens` (None: more than the largest)."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def fit_chunk(used: int, n: int, then: int, buckets: tuple[int, ...]) -> int:
    """Tokens to give the prompt chunk of n tokens that ends a step already holding `used` tokens, whose requests
    bring `then` tokens to the next step: n, or fewer so that the step ends on the bucket below, when that step and
    the next (`then` plus the cut tokens) pad to fewer bucket tokens together than the uncut step and its next (`then`
    plus this request's first decode). On a CPU backend a step costs about in proportion to its bucket. A chunk alone
    in its step (used 0) keeps n: cutting it would cost a step of its own. Never 0: no request is held back a step.

    E.g. 8 decodes and a 128-token prompt: buckets 256 then 16 (the 9 decodes); cut to 120: 128 then 16 (8 decodes
    and the prompt's last 8 tokens)."""
    total = used + n
    hi = bucket_of(buckets, total)
    if used <= 0 or hi is None or hi == total:
        return n
    lo = buckets[bisect.bisect_left(buckets, total) - 1]  # the largest bucket below total
    excess = total - lo
    after_cut = bucket_of(buckets, then + excess)
    if lo <= used or after_cut is None or lo + after_cut >= hi + bucket_of(buckets, then + 1):
        return n
    return n - excess
