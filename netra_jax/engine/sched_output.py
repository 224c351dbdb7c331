"""What one scheduler step hands the runner: each scheduled request's slice of tokens and block table, the step's
preemptions and finishes, and the prompt positions whose logprobs the step computes."""

from __future__ import annotations

from dataclasses import dataclass, field

from netra_jax.engine.request import Request

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logprobs one step computes at most (a static step shape)


def prompt_logprob_rows(req: Request, start: int, n: int) -> range:
    """Positions of [start, start + n) whose logits give a prompt logprob (each predicts the next prompt token, from
    the one before prompt token `req.prompt_logprobs_from` on); empty unless the request asks for prompt logprobs."""
    if req.sampling_params.prompt_logprobs is None:
        return range(0)
    return range(max(start, req.prompt_logprobs_from - 1), min(start + n, req.num_prompt_tokens - 1))


@dataclass
class ScheduledRequest:
    """Compute `request.all_token_ids[start:start + num_new_tokens]` at positions start.. into `block_ids` (the
    whole block table); `sample` is True when this reaches the end of the sequence, so a next token is drawn.
    With overlapped steps the last of these tokens may be a placeholder, sampled by the step still in flight
    (`token_ids` is then one shorter than num_new_tokens). `epoch`: the request's preemption count when scheduled.
    `spec_token_ids`: proposed tokens (speculative decoding) that end the chunk, verified by this step."""

    request: Request
    num_new_tokens: int
    start: int
    block_ids: list[int]
    sample: bool
    epoch: int = 0
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        known = self.request.all_token_ids[self.start : self.start + self.num_new_tokens - len(self.spec_token_ids)]
        return known + self.spec_token_ids if self.spec_token_ids else known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the previous schedule()
    settled: bool = False  # its results were applied (update_from_output) or its scheduling undone (cancel)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
