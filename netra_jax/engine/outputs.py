"""vLLM-shaped results of a request: RequestOutput with one CompletionOutput per sample, per-token logprobs and
timing metrics (arrival, first token, finish -> TTFT, TPOT, E2E)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob} holding the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    # with SamplingParams.logprobs set (0 is enough), per output token the sampled token's log-probability under the
    # raw distribution (log_softmax of the model's logits: the value in `logprobs`) and under the processed one it was
    # drawn from (after bias, penalties, temperature, min-p, top-k, top-p; greedy: after bias and penalties),
    # float32 values; `netra_jax.rl.sequence_logprobs` recomputes both bit for bit on a batch-invariant engine
    raw_logprobs: list[float] | None = None
    processed_logprobs: list[float] | None = None
    # with hooks that record: {hook name: [positions, ...]} of this sample (see RequestOutput.activations)
    activations: dict[str, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed inside the engine
    # with hooks that record (LLM.generate(..., hooks=...)): {hook name: [positions, ...]}, row p the activation at
    # the token in position p of prompt + output (the last output token never ran through the model); the first
    # sample's (with n > 1 each CompletionOutput has its own)
    activations: dict[str, Any] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0
