"""The sampling rows of a scheduled step: for each token the step samples, the draws, bias, penalties and grammar mask
its request's parameters and state give it (`ops.sampling.RowSampling`), speculative proposals included. Host only."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from netra_jax.engine.request_state import RequestState, SampleState
from netra_jax.engine.sched_output import ScheduledRequest
from netra_jax.ops import sampling
from netra_jax.sampling_params import SamplingParams

__all__ = ["row_sampling", "sampling_row", "sampling_rows"]


def sampling_rows(
    scheduled: Sequence[ScheduledRequest],
    state_of: Callable[[object], tuple[RequestState, SampleState] | None],
) -> list[sampling.RowSampling | None]:
    """One row per logit row of the step, in order: a request's row, and one more per speculative proposal (each
    drawn as the token after the proposals before it); None where no token is drawn (mid-prefill, or the request
    finished or left since it was scheduled). state_of: a scheduler request -> its (state, sample state) or None."""
    rows: list[sampling.RowSampling | None] = []
    for s in scheduled:
        entry = state_of(s.request) if s.sample and not s.request.is_finished else None
        drafts = s.spec_token_ids
        if entry is None:
            rows.extend([None] * (len(drafts) + 1))
            continue
        grammar = entry[1].grammar
        masks = grammar.masks_along(drafts) if grammar is not None and drafts else None
        rows.extend(
            sampling_row(entry[1], drafts[:j], None if masks is None else masks[j]) for j in range(len(drafts) + 1)
        )
    return rows


def sampling_row(sample: SampleState, drafts: Sequence[int] = (), mask=None) -> sampling.RowSampling:
    """The sampling row of the request's next token, or (speculative) of the token after proposals `drafts`: the
    draws, bias, penalties and grammar mask (`mask`, computed along the proposals) that token would get in a lone
    decode step after those tokens."""
    req = sample.request
    outputs = req.output_token_ids + list(drafts) if drafts else req.output_token_ids
    row = row_sampling(req.sampling_params, req.prompt_token_ids, outputs, req.eos_token_ids)
    if sample.grammar is not None:
        row.allowed = sample.grammar.mask() if mask is None else mask
    return row


def row_sampling(
    sp: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int], eos_token_ids: Collection[int] = ()
) -> sampling.RowSampling:
    """The sampling row of the token that follows `output_ids` after `prompt_ids` under `sp`, a grammar's mask
    aside: its temperature and filters, the seed and step of its draw, its logit bias (with EOS and the stop tokens
    banned while fewer than `sp.min_tokens` tokens are out) and its penalty history. What the engine's step samples
    with and what `netra_jax.rl.sequence_logprobs` recomputes each output token's logprobs with."""
    num_output = len(output_ids)
    bias = dict(sp.logit_bias) if sp.logit_bias else None
    if num_output < sp.min_tokens:  # EOS and stop tokens may not end it yet
        bias = bias or {}
        for t in (*eos_token_ids, *sp.stop_token_ids):
            bias[t] = float("-inf")
    row = sampling.RowSampling(
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        logit_bias=bias,
        seed=0 if sp.seed is None else sp.seed,  # (the engine gives every sample one)
        step=num_output,
        num_logprobs=sp.logprobs,
    )
    if row.uses_penalties:
        row.prompt_ids = prompt_ids
        row.output_ids = output_ids
    return row
