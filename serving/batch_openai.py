"""Batch request bodies through the server's own OpenAI layer: each body is parsed as the server's protocol model,
prepared by the same pipeline (serving.chat / serving.completion) and answered with the same response object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from netra_jax.engine.outputs import RequestOutput
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving import preprocess as pre
from netra_jax.serving.chat import ChatPlan, chat_response, prepare_chat
from netra_jax.serving.completion import CompletionPlan, completion_response, prepare_completion
from netra_jax.serving.context import ServingContext
from netra_jax.serving.errors import APIError, validation_message
from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest


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


@dataclass
class ChatJob:
    """One batch request on its way through the engine: its parsed request, its plan, and one engine prompt per
    prompt (a chat conversation has one)."""

    work: Any
    chat: bool
    req: ChatCompletionRequest | CompletionRequest
    plan: ChatPlan | CompletionPlan
    prompts: list[tuple[Any, SamplingParams]]
    rids: list[str] = field(default_factory=list)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.plan.params.n

    @property
    def num_seqs(self) -> int:
        return self.n * len(self.prompts)


def prepare(work: Any, ctx: ServingContext, chat: bool) -> ChatJob:
    """Validate a request body as the server does; RequestError names what is wrong."""
    body = work.body
    if isinstance(body, dict) and body.get("stream"):
        raise RequestError("stream is not supported in batch requests", param="stream")
    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate_json(json.dumps(body))
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise RequestError(message, param=param) from None
    try:
        pre.check_model(ctx, req.model)
        if isinstance(req, ChatCompletionRequest):
            plan = prepare_chat(ctx, req)
            return ChatJob(work, True, req, plan, [(plan.prompt, plan.params)])
        plan = prepare_completion(ctx, req)
        return ChatJob(work, False, req, plan, [(p, plan.params.clone()) for p in plan.prompts])
    except APIError as e:
        raise RequestError.of(e) from None


def response_body(job: ChatJob, outs: list[RequestOutput], ctx: ServingContext) -> dict[str, Any]:
    """The chat.completion or text_completion body the server would answer, as JSON data."""
    if job.chat:
        resp = chat_response(ctx, job.req, job.plan, outs)
    else:
        resp = completion_response(ctx, job.req, job.plan, outs)
    return resp.model_dump(mode="json", by_alias=True)
