"""One generation request as the scheduler sees it: token ids, progress through the KV cache, status and timings.
Host-only bookkeeping; the scheduler moves it between states and the engine reads its outputs."""

from __future__ import annotations

import enum
import itertools
import operator
import time
from collections.abc import Iterable, Sequence

from netra_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: "stop" | "length" | "abort" | "error", None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_creation_order = itertools.count()  # breaks ties of equal arrival times in the priority order


class ContextLengthError(ValueError):
    """A prompt (plus its max_tokens) does not fit the model's context; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, max_tokens_name: str = "max_tokens"
) -> None:
    """The one context-length rule (engine, scheduler and HTTP front all call it): a prompt must leave at least one
    token to generate, and prompt + max_tokens must fit `max_model_len`. Raises ContextLengthError."""
    # worded as OpenAI's and vLLM's: clients (litellm) read "maximum context length" to fall back to a larger model
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens} tokens in the prompt, which leaves none to generate. Please reduce the length of "
            "the prompt.",
            "prompt",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion: {max_tokens_name}). Please reduce the length of the prompt or {max_tokens_name}.",
            max_tokens_name,
        )


def _token_list(ids: Iterable[int], what: str) -> list[int]:
    out = []
    for t in ids:
        try:
            v = operator.index(t)
        except TypeError:
            raise ValueError(f"{what} must contain integer token ids, got {t!r}") from None
        if v < 0:
            raise ValueError(f"{what} contains a negative token id {v}")
        out.append(v)
    return out


class Request:
    """A prompt plus its generated tokens. `num_computed_tokens` counts the leading tokens whose KV is in the
    cache (in `block_ids`); each scheduler step computes more until it reaches `num_tokens`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        eos_token_ids: Iterable[int] | int | None = (),
        arrival_time: float | None = None,
        cache_key: str | bytes | None = None,
        priority: int = 0,
        prompt_logprobs_from: int = 1,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError("prompt_token_ids must be a sequence of token ids, not text")
        prompt = _token_list(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt; at least one token is needed")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if not isinstance(prompt_logprobs_from, int) or not 1 <= prompt_logprobs_from < max(2, len(prompt)):
            raise ValueError(
                f"request {request_id!r}: prompt_logprobs_from must be a prompt token index in [1, {len(prompt) - 1}]"
                f" (the first token has no logprob), got {prompt_logprobs_from!r}"
            )
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(_token_list(eos_token_ids, "eos_token_ids"))
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids or ())
        self.cache_key = cache_key  # mixed into the root of the block hash chain (e.g. adapter or model id)
        self.lora_id = 0  # the LoRA adapter it runs with (LoRARequest.lora_int_id; 0: the base model)
        # first prompt token whose logprob is wanted (with prompt logprobs): the tokens before it are context only,
        # so prefix-cache hits may cover them
        self.prompt_logprobs_from = prompt_logprobs_from
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt)

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV a finished step has written
        self.num_inflight_tokens = 0  # tokens scheduled in steps whose results the scheduler has not seen yet
        self.num_placeholders = 0  # sampled tokens of those steps: counted in the sequence, not yet known
        self.spec_token_ids: list[int] = []  # proposed next tokens (speculative decoding), verified when scheduled
        self.spec_misses = 0  # proposals in a row of which nothing was accepted
        self.spec_pause = 0  # decode steps left without proposals (2 ** misses - 1 after a miss)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # memo of the chained hashes of full blocks of all_token_ids
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.max_total_tokens: int | None = None  # prompt + output limit, resolved by the scheduler
        self.num_preemptions = 0

        self.arrival_time = time.time() if arrival_time is None else float(arrival_time)
        self.priority = priority  # smaller is served first under the "priority" scheduling policy
        self._order = next(_creation_order)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    # ------------------------------------------------------------------ token views
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_scheduled_end(self) -> int:
        """Position the next scheduled chunk starts at: computed tokens plus those in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens. The returned list is the request's own: read it, do not modify it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Order of service under the "priority" policy: priority, then arrival time, then creation order."""
        return self.priority, self.arrival_time, self._order

    @property
    def max_output_tokens(self) -> int | None:
        if self.max_total_tokens is None:
            return self.sampling_params.max_tokens
        return self.max_total_tokens - self.num_prompt_tokens

    def append_output(self, token_id: int) -> None:
        try:
            t = operator.index(token_id)
        except TypeError:
            raise ValueError(f"sampled token for request {self.request_id!r} is not an integer: {token_id!r}") from None
        if t < 0:
            raise ValueError(f"sampled token for request {self.request_id!r} is negative: {t}")
        self.output_token_ids.append(t)
        self._all_token_ids.append(t)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a finished request whose step appended several
        verified tokens, when a stop string ended it at an earlier one)."""
        if not self.is_finished:
            raise ValueError(f"request {self.request_id!r}: only a finished request's output can be cut")
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
