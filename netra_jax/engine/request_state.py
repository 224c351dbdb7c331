"""Host-side state of a user request between the input and output processors: its samples (one scheduler Request
each, n > 1 fans out), their detokenizers, text, logprobs and grammars, and the prompt's logprob rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from netra_jax.engine.outputs import Logprob
from netra_jax.engine.request import Request
from netra_jax.sampling_params import SamplingParams
from netra_jax.structured_output import GrammarMatcher
from netra_jax.tokenization.detokenizer import IncrementalDetokenizer


@dataclass
class SampleState:
    """One sample (one scheduler Request) of a user request."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    text: str = ""  # detokenized text, stop string cut
    emitted: int = 0  # characters of `text` already returned as deltas
    tokens_emitted: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    raw_logprobs: list[float] | None = None  # each output token's logprob, raw and processed (with logprobs)
    processed_logprobs: list[float] | None = None
    grammar: GrammarMatcher | None = None  # structured output: masks each step, ends the request when complete


@dataclass
class RequestState:
    """A user request: its prompt, parameters and samples. prompt_logprobs: vLLM's list (None for the first
    token, then one dict per prompt token), filled as the prefill steps compute its rows; only from token
    `prompt_logprobs_from` on when that is above 1 (the entries before it stay None)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    arrival: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_from: int = 1
