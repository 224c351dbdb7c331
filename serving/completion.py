"""The completions pipeline without HTTP: a request becomes one engine prompt per prompt given, with its
SamplingParams (prepare_completion); engine outputs become a text_completion (completion_response). vLLM's echo:
the prompt's text, and with logprobs the prompt's logprobs, open each choice; with max_tokens 0 they are all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from netra_jax.engine.engine import PromptType
from netra_jax.engine.outputs import RequestOutput
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving import preprocess as pre
from netra_jax.serving.context import ServingContext
from netra_jax.serving.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from netra_jax.serving.render import (
    completion_logprobs,
    echo_logprobs,
    finish,
    join_logprobs,
    prompt_logprobs,
    usage,
)


@dataclass
class CompletionPlan:
    """A prepared completions request: one engine prompt per prompt given (choice index = prompt * n + sample).
    `echo`: each prompt's text, put before its choices' text; `echo_only`: echo with max_tokens 0, the choices are
    the prompts alone (vLLM runs one step and drops its token; usage still counts it, as vLLM's)."""

    id: str
    engine_id: str
    prompts: list[PromptType]
    prompt_ids: list[list[int]]
    params: SamplingParams
    num_logprobs: int | None
    echo: list[str] | None
    priority: int
    echo_only: bool = False


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> CompletionPlan:
    """Validate `req` against the served model and tokenize its prompts (APIError(400) naming the field)."""
    pre.completion_checks(req)
    prompts = pre.completion_prompts(ctx.llm, req)
    params = pre.sampling_params(ctx.llm, engine_request(req), req.logprobs, [len(ids) for _, ids in prompts])
    echo = None
    if req.echo:
        tok = ctx.llm.tokenizer
        echo = [t if t is not None else tok.decode(ids, req.skip_special_tokens) for t, ids in prompts]
    rid = pre.response_id("cmpl", req)
    return CompletionPlan(
        id=rid,
        engine_id=pre.engine_id(rid, req),
        prompts=[{"prompt": t, "prompt_token_ids": ids} if t else ids for t, ids in prompts],
        prompt_ids=[ids for _, ids in prompts],
        params=params,
        num_logprobs=req.logprobs,
        echo=echo,
        priority=req.priority,
        echo_only=req.echo and req.max_tokens == 0,
    )


def engine_request(req: CompletionRequest) -> CompletionRequest:
    """`req` as the engine runs it, vLLM's echo rules applied: echo with logprobs computes the prompt's logprobs
    (as many alternatives as `logprobs`, unless prompt_logprobs says), echo with max_tokens 0 runs one step."""
    if not req.echo:
        return req
    update: dict[str, int] = {}
    if req.prompt_logprobs is None and req.logprobs is not None:
        update["prompt_logprobs"] = req.logprobs
    if req.max_tokens == 0:
        update["max_tokens"] = 1
    return req.model_copy(update=update) if update else req


def completion_response(
    ctx: ServingContext, req: CompletionRequest, plan: CompletionPlan, outs: Sequence[RequestOutput]
) -> CompletionResponse:
    """The text_completion for a finished request: one RequestOutput per prompt, in prompt order."""
    choices = []
    k = plan.num_logprobs
    for i, out in enumerate(outs):
        head, head_lps = "", None
        if plan.echo is not None:
            head = plan.echo[i]
            if k is not None:
                skip = plan.params.skip_special_tokens
                head_lps = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, ctx.tokens, k, skip)
        for o in out.outputs:
            lps = None
            if k is not None and not plan.echo_only:
                lps = completion_logprobs(o.logprobs or [], ctx.tokens, k, len(head))
            reason, stop_reason = finish(o)
            choice = CompletionChoice(
                index=i * plan.params.n + o.index,
                text=head if plan.echo_only else head + o.text,
                logprobs=join_logprobs(head_lps, lps),
                finish_reason=reason,
                stop_reason=stop_reason,
            )
            if req.return_token_ids:
                choice.token_ids = [] if plan.echo_only else list(o.token_ids)
                choice.prompt_token_ids = list(out.prompt_token_ids)
            if plan.params.prompt_logprobs is not None:  # vLLM shows them whenever computed (echo with logprobs too)
                choice.prompt_logprobs = prompt_logprobs(out.prompt_logprobs, ctx.tokens)
            choices.append(choice)
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=plan.id, model=ctx.model_name, choices=choices, usage=usage(outs))
