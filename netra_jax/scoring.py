"""Scoring given continuations (lm-evaluation-harness's `loglikelihood`): pairs tokenized as lm-eval pairs them,
each scored from the prompt logprobs that an ordinary request over prompt + continuation computes in its prefill."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from netra_jax.engine.outputs import RequestOutput
from netra_jax.sampling_params import SamplingParams
from netra_jax.tokenization.tokenizer import Tokenizer

__all__ = ["ContinuationScore", "continuation_score", "encode_pair", "pair_token_ids", "scoring_params"]

TextOrIds = str | Sequence[int]


@dataclass(frozen=True)
class ContinuationScore:
    """The score of one continuation given its prompt.

    Attributes:
        prompt_token_ids: The prompt's tokens (the context).
        continuation_token_ids: The continuation's tokens, scored one by one after the prompt.
        token_logprobs: Log-probability of each continuation token given everything before it.
        ranks: Rank of each continuation token among the vocabulary at its position (1: the most likely).
        logprob: Sum of `token_logprobs`: the log-likelihood of the continuation (lm-eval's first value).
        is_greedy: True when every continuation token is the most likely one at its position, i.e. greedy decoding
            from the prompt would produce the continuation (lm-eval's second value).
        num_cached_tokens: Prompt tokens whose KV came from the prefix cache instead of being computed.
    """

    prompt_token_ids: list[int]
    continuation_token_ids: list[int]
    token_logprobs: list[float]
    ranks: list[int]
    logprob: float
    is_greedy: bool
    num_cached_tokens: int = 0


def scoring_params() -> SamplingParams:
    """The parameters of a scoring request: the prompt's logprobs (no alternatives) and one greedy token, which ends
    it right after its prefill. Seeded, so scoring draws nothing from the engine's seed stream."""
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, seed=0)


def encode_pair(
    tokenizer: Tokenizer, prompt: str, continuation: str, add_special_tokens: bool = False
) -> tuple[list[int], list[int]]:
    """Tokenize a text pair as lm-evaluation-harness does (`TemplateLM._encode_pair`): the prompt's trailing
    whitespace moves to the front of the continuation, the continuation's tokens are those of the whole text after
    as many tokens as the prompt alone has (so the boundary is tokenized in context).

    Args:
        tokenizer: The model's tokenizer.
        prompt: The context text.
        continuation: The text to score after it.
        add_special_tokens: Let the tokenizer add its special tokens (e.g. a BOS) to the prompt; lm-eval's default
            is not to.

    Returns:
        The prompt's token ids and the continuation's token ids.
    """
    n = len(prompt) - len(prompt.rstrip())
    if n:
        prompt, continuation = prompt[:-n], prompt[-n:] + continuation
    whole = tokenizer.encode(prompt + continuation, add_special_tokens=add_special_tokens)
    context = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return context, whole[len(context) :]


def pair_token_ids(
    tokenizer: Tokenizer, prompt: TextOrIds, continuation: TextOrIds, add_special_tokens: bool = False
) -> tuple[list[int], list[int]]:
    """The token ids of one (prompt, continuation) pair, each given as text or as token ids: two texts are tokenized
    together by `encode_pair`; token ids are taken as they are; a text continuation after a token-id prompt is
    refused (it is tokenized in its context, which token ids do not give). A text prompt with a token-id
    continuation is tokenized alone (`add_special_tokens` as given).

    Raises:
        ValueError: An empty prompt or continuation (also one that tokenizes to no token), a text continuation after a
            token-id prompt, or something that is neither text nor a sequence of integers.
    """
    if isinstance(continuation, str):
        if not continuation:
            raise ValueError("empty continuation: there is nothing to score")
        if not isinstance(prompt, str):
            raise ValueError(
                "a text continuation needs a text prompt (it is tokenized in the prompt's context); give the "
                "continuation as token ids, or the prompt as text"
            )
        if not prompt:
            raise ValueError("empty prompt: a continuation is scored given at least one prompt token")
        ctx, cont = encode_pair(tokenizer, prompt, continuation, add_special_tokens)
    else:
        ctx = _ids(prompt, "prompt", tokenizer, add_special_tokens)
        cont = _ids(continuation, "continuation", tokenizer, False)
    if not ctx:
        raise ValueError(f"prompt {prompt!r} has no tokens: a continuation is scored given at least one prompt token")
    if not cont:
        raise ValueError(f"continuation {continuation!r} has no tokens: there is nothing to score")
    return ctx, cont


def _ids(x: TextOrIds, what: str, tokenizer: Tokenizer, add_special_tokens: bool) -> list[int]:
    if isinstance(x, str):
        return tokenizer.encode(x, add_special_tokens=add_special_tokens) if x else []
    if isinstance(x, bytes) or not isinstance(x, Sequence):
        raise ValueError(f"a {what} must be text or a sequence of token ids, got {type(x).__name__}")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in x):
        raise ValueError(f"a {what} given as token ids must hold integers only")
    return [int(t) for t in x]


def continuation_score(output: RequestOutput, num_prompt_tokens: int) -> ContinuationScore:
    """The score of a finished scoring request over prompt + continuation (`scoring_params`, prompt logprobs from
    token `num_prompt_tokens` on): its continuation tokens' prompt logprobs and ranks.

    Raises:
        RuntimeError: The request ended without its prompt logprobs (aborted or failed in the engine).
    """
    ids = output.prompt_token_ids
    rows = output.prompt_logprobs
    if rows is None or output.error:
        raise RuntimeError(f"request {output.request_id} ended without its scores: {output.error or 'no logprobs'}")
    cont = ids[num_prompt_tokens:]
    entries = [rows[num_prompt_tokens + i][t] for i, t in enumerate(cont)]
    lps = [e.logprob for e in entries]
    ranks = [e.rank for e in entries]
    return ContinuationScore(
        prompt_token_ids=list(ids[:num_prompt_tokens]),
        continuation_token_ids=list(cont),
        token_logprobs=lps,
        ranks=ranks,
        logprob=float(sum(lps)),
        is_greedy=all(r == 1 for r in ranks),
        num_cached_tokens=output.num_cached_tokens,
    )
