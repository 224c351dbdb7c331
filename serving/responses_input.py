"""A Responses request as the chat request it means: instructions as the first (system) message, input items as chat
messages (function calls as assistant tool_calls, their outputs as role tool), flat function tools nested, text.format
as response_format; then prepared by the chat pipeline, its errors renamed to the Responses fields."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from netra_jax.serving.chat import ChatPlan, prepare_chat
from netra_jax.serving.context import ServingContext
from netra_jax.serving.errors import APIError
from netra_jax.serving.preprocess import bad
from netra_jax.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    FunctionCallParam,
    FunctionDefinition,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallParam,
)
from netra_jax.serving.protocol_responses import (
    OUTPUT_TEXT_LOGPROBS,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    OtherItem,
    OtherTool,
    OtherToolChoice,
    ReasoningItem,
    ResponsesRequest,
    ToolChoiceFunction,
)

TEXT_PARTS = ("input_text", "output_text", "text")
STATELESS = (
    "this server keeps no responses (it runs without a response store, as vLLM does unless "
    "VLLM_ENABLE_RESPONSES_API_STORE is set), so {what}; send the whole conversation in `input` instead"
)
# chat request fields -> the Responses fields they came from (for error messages and params)
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "top_logprobs",  # SamplingParams' name of the number of alternatives
}


@dataclass
class ResponsesPlan:
    """A prepared Responses request: the chat request it became and that request's plan. `id`: resp_..., or the
    request's request_id as it is (vLLM)."""

    id: str
    created_at: int
    req: ResponsesRequest
    chat_req: ChatCompletionRequest
    chat: ChatPlan


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for k, part in enumerate(content):
        if part.type in TEXT_PARTS and part.text is not None:
            out.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            out.append(part.refusal)
        elif part.type in TEXT_PARTS or part.type == "refusal":
            raise bad(f"{param}.{k}: a {part.type} part needs its text", f"{param}.{k}")
        else:
            raise bad(
                f"{param}.{k}: {part.type} parts are not supported: this server serves text-only models",
                f"{param}.{k}.type",
            )
    return "".join(out)


def _reasoning_text(item: ReasoningItem) -> str:
    parts = item.content if item.content else item.summary  # encrypted_content alone cannot be read: dropped
    return "".join(p.text or "" for p in parts)


@dataclass
class Origins:
    """Where each chat message came from in the Responses request ("instructions" or "input.<i>"), and each of
    its tool calls (the function_call items merged into one assistant turn)."""

    messages: list[str] = field(default_factory=list)
    calls: list[list[str]] = field(default_factory=list)

    def add(self, where: str, calls: list[str]) -> None:
        self.messages.append(where)
        self.calls.append(calls)

    def of(self, k: int, call: int | None = None) -> str:
        """messages[k] (its tool_calls[call]) as the Responses field; "input" when out of range."""
        if k >= len(self.messages):
            return "input"
        if call is not None and call < len(self.calls[k]):
            return f"{self.calls[k][call]}.arguments"
        return self.messages[k]


def _messages(req: ResponsesRequest) -> tuple[list[ChatMessage], Origins]:
    """The chat messages and where each came from."""
    msgs: list[ChatMessage] = []
    where = Origins()
    if req.instructions is not None:
        msgs.append(ChatMessage(role="system", content=req.instructions))
        where.add("instructions", [])
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise bad("input is empty: give a text or at least one message", "input")
    names: dict[str, str] = {}  # call_id -> function name, for the tool message answering it
    thought: str | None = None  # reasoning waiting for the assistant turn that follows it
    for j, item in enumerate(items):
        at = f"input.{j}"
        if isinstance(item, OtherItem):
            raise bad(
                f"{at}: items of type {item.type!r} are not supported (only messages, function_call, "
                "function_call_output and reasoning items; built-in tools and item references are not served)",
                f"{at}.type",
            )
        if isinstance(item, ReasoningItem):
            thought = (thought or "") + _reasoning_text(item)
            continue
        if isinstance(item, FunctionCallItem):
            call = ToolCallParam(id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments))
            names[item.call_id] = item.name
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant" and thought is None:
                last.tool_calls = [*(last.tool_calls or []), call]  # calls of the same answer: one assistant turn
                where.calls[-1].append(at)
                continue
            msg = ChatMessage(role="assistant", content=None, tool_calls=[call])
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:  # OpenAI's rule: an output answers a function_call item given before it
                raise bad(
                    f"{at}: no function_call item before it has call_id {item.call_id!r}; a function_call_output "
                    "answers a call sent earlier in input (this server keeps no previous responses)",
                    f"{at}.call_id",
                )
            content = _text(item.output, f"{at}.output")
            msg = ChatMessage(role="tool", content=content, tool_call_id=item.call_id, name=names[item.call_id])
        else:
            msg = ChatMessage(role=item.role, content=_text(item.content, f"{at}.content"))
        if msg.role == "assistant" and thought is not None:
            msg.reasoning_content, thought = thought, None
        msgs.append(msg)
        where.add(at, [at] if msg.tool_calls else [])
    if not msgs:
        raise bad("input holds no message (reasoning items alone)", "input")
    return msgs, where


def _tools(req: ResponsesRequest) -> list[ChatCompletionTool] | None:
    if not req.tools:  # [] is no tools (the Agents SDK sends it; chat requests refuse an empty list)
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if isinstance(tool, OtherTool):
            raise bad(
                f"tools.{i}: built-in tool {tool.type!r} is not supported; only function tools", f"tools.{i}.type"
            )
        out.append(ChatCompletionTool(function=FunctionDefinition(**tool.model_dump(exclude={"type"}))))
    return out


def _tool_choice(req: ResponsesRequest) -> Any:
    tc = req.tool_choice
    if isinstance(tc, OtherToolChoice):
        if tc.type == "function":
            raise bad('tool_choice: a function choice is {"type": "function", "name": ...}', "tool_choice")
        raise bad(
            f"tool_choice {tc.type!r} is not supported: give none, auto, required or a function "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    if isinstance(tc, ToolChoiceFunction):
        return NamedToolChoice(function=NamedFunction(name=tc.name))
    return tc


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad("text.format: a json_schema format needs its schema", "text.format.schema", "invalid_response_format")
    spec = JsonSchemaSpec(
        name=fmt.name or "response", description=fmt.description, json_schema=fmt.json_schema, strict=fmt.strict
    )
    return ResponseFormat(type="json_schema", json_schema=spec)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        what = "a response cannot continue from previous_response_id"
        raise bad(STATELESS.format(what=what), "previous_response_id", "unsupported_parameter")
    if req.conversation is not None:
        what = "a response cannot be added to a conversation"
        raise bad(STATELESS.format(what=what), "conversation", "unsupported_parameter")
    if req.background:
        what = "background mode (answered later by id) is not available"
        raise bad(STATELESS.format(what=what), "background", "unsupported_parameter")
    if req.prompt is not None:
        raise bad("prompt: stored prompt templates are not supported; send instructions and input", "prompt")
    if req.truncation == "auto":
        raise bad(
            "truncation 'auto' is not supported: an input longer than the context is a 400; send a shorter input",
            "truncation",
        )
    for i, name in enumerate(req.include or ()):
        if name != OUTPUT_TEXT_LOGPROBS:
            raise bad(f"include: {name!r} is not supported (only {OUTPUT_TEXT_LOGPROBS!r})", f"include.{i}")


def chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, Origins]:
    """The chat request `req` means, and where each of its messages came from (see _messages). APIError(400)
    naming the field for what cannot be served."""
    _refuse_unsupported(req)
    messages, where = _messages(req)
    logprobs = OUTPUT_TEXT_LOGPROBS in (req.include or ())
    fmt = _response_format(req)
    # text.format shapes the message text; a forced function call writes none, under its own grammar
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, ToolChoiceFunction)
    chat = ChatCompletionRequest(
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=None if forced else fmt,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        logit_bias=req.logit_bias,
        skip_special_tokens=req.skip_special_tokens,
        priority=req.priority,
        request_id=req.request_id,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    return chat, where


def remap_error(e: APIError, where: Origins) -> APIError:
    """A chat pipeline error in the Responses request's terms: `messages.<k>` becomes the input item (or
    instructions) message k came from (a tool call's arguments, its function_call item's), chat field names the
    Responses ones (max_completion_tokens -> max_output_tokens, response_format -> text.format,
    tools.<i>.function.<f> -> tools.<i>.<f>)."""

    def message_at(m: re.Match) -> str:
        return where.of(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))

    param = e.param
    if param is not None:
        if m := re.match(r"messages\.(\d+)(?:\.tool_calls\.(\d+))?", param):
            param = message_at(m)
        elif param == "messages":
            param = "input"
        else:
            head, dot, rest = param.partition(".")
            param = RENAMED.get(head, head) + dot + rest
            param = re.sub(r"^tools\.(\d+)\.function\.", r"tools.\1.", param)
    message = re.sub(r"\bmessages\[(\d+)\](?:\.tool_calls\[(\d+)\]\.function\.arguments)?", message_at, e.message)
    for old, new in RENAMED.items():
        message = re.sub(rf"\b{old}\b", new, message)
    return APIError(e.status, message, param, e.code, e.type, e.headers)


def prepare_responses(ctx: ServingContext, req: ResponsesRequest) -> ResponsesPlan:
    """Validate `req` and render its prompt (APIError(400) naming the Responses field). Runs the chat template: the
    server calls this in a thread."""
    chat_req, where = chat_request(req)
    try:
        plan = prepare_chat(ctx, chat_req)
    except APIError as e:
        raise remap_error(e, where) from None
    rid = req.request_id if req.request_id is not None else f"resp_{uuid.uuid4().hex}"
    return ResponsesPlan(rid, int(time.time()), req, chat_req, plan)
