"""The completions pipeline without HTTP: a request becomes one engine prompt per prompt given, with its
SamplingParams (prepare_completion); engine outputs become a text_completion (completion_response)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from netra_jax.engine.engine import PromptType
from netra_jax.engine.outputs import RequestOutput
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving import preprocess as pre
from netra_jax.serving.context import ServingContext
from netra_jax.serving.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from netra_jax.serving.render import completion_logprobs, finish, prompt_logprobs, usage


@dataclass
class CompletionPlan:
    """A prepared completions request: one engine prompt per prompt given (choice index = prompt * n + sample).
    `echo`: each prompt's text, put before its choices' text."""

    id: str
    engine_id: str
    prompts: list[PromptType]
    prompt_ids: list[list[int]]
    params: SamplingParams
    num_logprobs: int | None
    echo: list[str] | None
    priority: int


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> CompletionPlan:
    """Validate `req` against the served model and tokenize its prompts (APIError(400) naming the field)."""
    pre.completion_checks(req)
    prompts = pre.completion_prompts(ctx.llm, req)
    params = pre.sampling_params(ctx.llm, req, req.logprobs, [len(ids) for _, ids in prompts])
    echo = None
    if req.echo:
        tok = ctx.llm.tokenizer
        echo = [t if t is not None else tok.decode(ids, req.skip_special_tokens) for t, ids in prompts]
    rid = pre.response_id("cmpl", req)
    return CompletionPlan(
        id=rid,
        engine_id=rid if req.request_id is None else f"{rid}-{uuid.uuid4().hex[:12]}",
        prompts=[{"prompt": t, "prompt_token_ids": ids} if t else ids for t, ids in prompts],
        prompt_ids=[ids for _, ids in prompts],
        params=params,
        num_logprobs=req.logprobs,
        echo=echo,
        priority=req.priority,
    )


def completion_response(
    ctx: ServingContext, req: CompletionRequest, plan: CompletionPlan, outs: Sequence[RequestOutput]
) -> CompletionResponse:
    """The text_completion for a finished request: one RequestOutput per prompt, in prompt order."""
    choices = []
    for i, out in enumerate(outs):
        head = plan.echo[i] if plan.echo else ""
        for o in out.outputs:
            lps = None
            if plan.num_logprobs is not None and o.logprobs is not None:
                lps = completion_logprobs(o.logprobs, ctx.tokens, plan.num_logprobs, len(head))
            reason, stop_reason = finish(o)
            choice = CompletionChoice(
                index=i * plan.params.n + o.index,
                text=head + o.text,
                logprobs=lps,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
            if req.return_token_ids:
                choice.token_ids, choice.prompt_token_ids = list(o.token_ids), list(out.prompt_token_ids)
            if req.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs(out.prompt_logprobs, ctx.tokens)
            choices.append(choice)
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=plan.id, model=ctx.model_name, choices=choices, usage=usage(outs))
