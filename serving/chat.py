"""The chat-completions pipeline without HTTP: a request becomes one templated prompt and its SamplingParams
(prepare_chat), engine outputs become a chat.completion (chat_response). The server and batch jobs both use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netra_jax.engine.outputs import CompletionOutput, RequestOutput
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving import preprocess as pre
from netra_jax.serving.chat_messages import chat_messages, template_tools
from netra_jax.serving.chat_output import ChatOutput
from netra_jax.serving.context import ServingContext
from netra_jax.serving.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionTool,
    ChatLogprobs,
)
from netra_jax.serving.render import chat_logprobs, finish, prompt_logprobs, usage


@dataclass
class ChatPlan:
    """A prepared chat request. `engine_id` names its engine request (unique even when the client reuses a
    request_id); `echo`: the final assistant message's text, put before each choice's text (vLLM's echo)."""

    id: str
    engine_id: str
    prompt: dict[str, Any] | list[int]  # {"prompt": text, "prompt_token_ids": ids}, or ids once truncated
    prompt_ids: list[int]
    params: SamplingParams
    num_logprobs: int | None  # alternatives per sampled token; None: no logprobs
    echo: str | None
    priority: int
    output: ChatOutput  # how each choice's text is read: reasoning, tool calls, content


def render_chat(
    ctx: ServingContext, req: ChatCompletionRequest, tools: list[ChatCompletionTool] | None
) -> tuple[list[dict[str, Any]], str, list[int]]:
    """The conversation through the chat template with the request's template fields (add_generation_prompt,
    continue_final_message, chat_template_kwargs, reasoning_effort) and `tools`: (the template's messages, the
    prompt text, its ids). The chat route and /tokenize render with it."""
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise pre.bad(
                "continue_final_message and add_generation_prompt cannot both be true", "add_generation_prompt"
            )
        if req.messages[-1].role != "assistant":
            raise pre.bad("continue_final_message needs an assistant message last", "continue_final_message")
        add_generation_prompt = False
    messages = chat_messages(req.messages)
    text, ids = pre.chat_prompt(
        ctx.llm,
        messages,
        add_generation_prompt,
        ctx.chat_template,
        req.continue_final_message,
        template_tools(tools),
        **pre.template_kwargs(req),
    )
    return messages, text, ids


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatPlan:
    """Validate `req` against the served model and render its prompt (APIError(400) naming the field). The chat
    template may run up to its time limit: the server calls this in a thread."""
    k = pre.chat_checks(req)
    tools = ctx.chat_output.plan_tools(req)
    messages, text, ids = render_chat(ctx, req, tools.tools)
    kept = pre.truncate(ctx.llm, ids, req.truncate_prompt_tokens)
    params = pre.sampling_params(ctx.llm, req, k, [len(kept)])
    constrained = params.structured_outputs is not None or tools.structured_outputs is not None
    output = ChatOutput.plan(ctx.chat_output, req, tools, ctx.llm.tokenizer, text, constrained)
    output.adjust(params)
    echo = None
    if req.echo and req.messages[-1].role == "assistant":
        echo = messages[-1].get("content") or ""
    rid = pre.response_id("chatcmpl", req)
    return ChatPlan(
        id=rid,
        engine_id=pre.engine_id(rid, req),
        prompt={"prompt": text, "prompt_token_ids": ids} if len(kept) == len(ids) else kept,
        prompt_ids=kept,
        params=params,
        num_logprobs=k,
        echo=echo,
        priority=req.priority,
        output=output,
    )


def _choice(req: ChatCompletionRequest, plan: ChatPlan, ctx: ServingContext, o: CompletionOutput) -> ChatChoice:
    lps = None
    if plan.num_logprobs is not None and o.logprobs is not None:
        lps = ChatLogprobs(content=chat_logprobs(o.logprobs, ctx.tokens, plan.num_logprobs))
    reader = plan.output.choice()
    message = reader.message(o.text)
    if plan.echo:
        message.content = plan.echo + (message.content or "")
    reason, stop_reason = finish(o)
    return ChatChoice(
        index=o.index,
        message=message,
        logprobs=lps,
        finish_reason=reader.finish_reason(reason),
        stop_reason=stop_reason,
        token_ids=list(o.token_ids) if req.return_token_ids else None,
    )


def chat_response(
    ctx: ServingContext, req: ChatCompletionRequest, plan: ChatPlan, outs: Sequence[RequestOutput]
) -> ChatCompletionResponse:
    """The chat.completion for a finished request (its one RequestOutput)."""
    (out,) = outs
    resp = ChatCompletionResponse(
        id=plan.id,
        model=ctx.model_name,
        choices=[_choice(req, plan, ctx, o) for o in out.outputs],
        usage=usage(outs),
    )
    if req.return_token_ids:
        resp.prompt_token_ids = list(out.prompt_token_ids)
    if req.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_logprobs(out.prompt_logprobs, ctx.tokens)
    return resp
