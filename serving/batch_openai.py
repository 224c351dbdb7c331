"""Batch request bodies through the server's own OpenAI layer: each body is parsed as the server's protocol model,
prepared by the same pipeline (serving.chat / completion / responses_input) and answered with the same object."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from netra_jax.engine.outputs import RequestOutput
from netra_jax.lora_request import LoRARequest
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving import preprocess as pre
from netra_jax.serving.batch_io import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL
from netra_jax.serving.chat import ChatPlan, chat_response, prepare_chat
from netra_jax.serving.completion import CompletionPlan, completion_response, prepare_completion
from netra_jax.serving.context import ServingContext
from netra_jax.serving.errors import APIError, validation_message
from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest
from netra_jax.serving.protocol_responses import ResponsesRequest
from netra_jax.serving.responses_input import ResponsesPlan, prepare_responses
from netra_jax.serving.responses_output import responses_response


class RequestError(ValueError):
    """A request the server would refuse: HTTP `status`, the batch error `code`, the offending `param`, and the
    code of the server's error envelope (`api_code`, None for a validation error)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
        api_code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.param, self.api_code = status, code, param, api_code

    @classmethod
    def of(cls, e: APIError) -> RequestError:
        return cls(e.message, e.status, e.code or "invalid_request", e.param, e.code)


@dataclass(frozen=True)
class Route:
    """One batch url: its request model, the server's prepare function, and how a plan answers."""

    request: type[BaseModel]
    prepare: Callable[[ServingContext, Any], Any]
    respond: Callable[[ServingContext, Any, Any, list[RequestOutput]], BaseModel]


def _chat(plan: ChatPlan | ResponsesPlan) -> ChatPlan:
    return plan.chat if isinstance(plan, ResponsesPlan) else plan


ROUTES = {
    CHAT_URL: Route(ChatCompletionRequest, prepare_chat, chat_response),
    COMPLETIONS_URL: Route(CompletionRequest, prepare_completion, completion_response),
    RESPONSES_URL: Route(
        ResponsesRequest, prepare_responses, lambda ctx, req, plan, outs: responses_response(ctx, plan, outs)
    ),
}


@dataclass
class Job:
    """One batch request on its way through the engine: its route, parsed request and plan, and one engine prompt
    per prompt (a conversation has one)."""

    work: Any
    route: Route
    req: BaseModel
    plan: ChatPlan | CompletionPlan | ResponsesPlan
    prompts: list[tuple[Any, SamplingParams]]
    rids: list[str] = field(default_factory=list)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    lora: LoRARequest | None = None  # the LoRA adapter the body's model names

    @property
    def params(self) -> SamplingParams:
        return self.plan.params if isinstance(self.plan, CompletionPlan) else _chat(self.plan).params

    @property
    def priority(self) -> int:
        return self.plan.priority if isinstance(self.plan, CompletionPlan) else _chat(self.plan).priority

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_seqs(self) -> int:
        return self.n * len(self.prompts)


def prepare(work: Any, ctx: ServingContext) -> Job:
    """Validate a request body as the server's route for `work.url` does; RequestError names what is wrong."""
    route = ROUTES[work.url]
    body = work.body
    if isinstance(body, dict) and body.get("stream"):
        raise RequestError("stream is not supported in batch requests", param="stream")
    try:
        req = route.request.model_validate_json(json.dumps(body))
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise RequestError(message, param=param) from None
    try:
        lora = pre.check_model(ctx, req.model)
        plan = route.prepare(ctx, req)
    except APIError as e:
        raise RequestError.of(e) from None
    if isinstance(plan, CompletionPlan):
        prompts = [(p, plan.params.clone()) for p in plan.prompts]
    else:
        prompts = [(_chat(plan).prompt, _chat(plan).params)]
    return Job(work, route, req, plan, prompts, lora=lora)


def response_body(job: Job, outs: list[RequestOutput], ctx: ServingContext) -> dict[str, Any]:
    """The body the server would answer (chat.completion, text_completion or response), as JSON data."""
    return job.route.respond(ctx, job.req, job.plan, outs).model_dump(mode="json", by_alias=True)
