"""Answers in the Responses API's shapes: the `response` object with its output items (reasoning, message, function
calls) and usage, whole from the chat pipeline's answer, or streamed as OpenAI's event sequence (response.created,
output_item.added, content_part.added, output_text.delta, ..., response.completed), each with its sequence_number."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from netra_jax.engine.outputs import RequestOutput
from netra_jax.serving.chat import chat_response
from netra_jax.serving.context import ServingContext
from netra_jax.serving.generation import Generation
from netra_jax.serving.protocol import ChatLogprobEntry, DeltaToolCall, FunctionCall, ToolCall, UsageInfo
from netra_jax.serving.protocol_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
    TextFormat,
)
from netra_jax.serving.render import chat_logprobs, usage
from netra_jax.serving.responses_input import ResponsesPlan
from netra_jax.serving.streaming import output_events, stream_failure


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------- whole
def message_item(text: str, status: ItemStatus, logprobs: list[ChatLogprobEntry], item_id: str = "") -> OutputMessage:
    return OutputMessage(id=item_id or _id("msg"), status=status, content=[OutputText(text=text, logprobs=logprobs)])


def reasoning_item(text: str, status: ItemStatus, item_id: str = "") -> OutputReasoning:
    return OutputReasoning(id=item_id or _id("rs"), content=[ReasoningText(text=text)], status=status)


def function_call_item(call: ToolCall, status: ItemStatus, item_id: str = "") -> OutputFunctionCall:
    fn = call.function
    return OutputFunctionCall(
        id=item_id or _id("fc"), call_id=call.id, name=fn.name, arguments=fn.arguments, status=status
    )


def output_items(
    reasoning: str | None, content: str | None, calls: Sequence[ToolCall], logprobs: list[ChatLogprobEntry], done: bool
) -> list[OutputItem]:
    """One answer's output: its reasoning, its message, its function calls. The message is left out when the answer
    wrote no text but reasoned or made calls (an empty answer still has its empty message). The last item is
    `incomplete` when the answer did not end by itself (`done` false)."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(reasoning_item(reasoning, "completed"))
    if content or not (calls or reasoning):
        items.append(message_item(content or "", "completed", logprobs))
    items += [function_call_item(c, "completed") for c in calls]
    if not done:
        items[-1].status = "incomplete"
    return items


def outcome(finish_reason: str | None) -> tuple[ResponseStatus, ResponseError | None]:
    """The response's status for the engine's finish reason: cut at max_output_tokens (or the context) is
    incomplete; ended by the engine (an output constraint that allowed no token, an abort) failed."""
    if finish_reason == "length":
        return "incomplete", None
    if finish_reason in ("error", "abort"):
        return "failed", ResponseError(code="server_error", message=f"the generation ended early ({finish_reason})")
    return "completed", None


def response_usage(ctx: ServingContext, use: UsageInfo, reasoning: str | None) -> ResponseUsage:
    """OpenAI's usage. reasoning_tokens: the reasoning text re-encoded (reasoning parsers split text, not ids)."""
    cached = use.prompt_tokens_details.cached_tokens if use.prompt_tokens_details else 0
    thought = len(ctx.llm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return ResponseUsage(
        input_tokens=use.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=use.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(thought, use.completion_tokens)),
        total_tokens=use.total_tokens,
    )


def response_object(
    plan: ResponsesPlan,
    model: str,
    output: list[OutputItem],
    status: ResponseStatus,
    usage: ResponseUsage | None = None,
    error: ResponseError | None = None,
) -> ResponseObject:
    """The `response` object: `output` and `status` with the request's settings as applied (sampling after its
    defaults; tool_choice "auto" when tools came without one, else "none"; store always false)."""
    req, params = plan.req, plan.chat.params
    tools = [t for t in req.tools or () if isinstance(t, FunctionTool)]
    choice: Any = req.tool_choice if req.tool_choice is not None else "auto" if tools else "none"
    return ResponseObject(
        id=plan.id,
        created_at=plan.created_at,
        status=status,
        model=model,
        output=output,
        usage=usage,
        error=error,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_logprobs=plan.chat.num_logprobs,
        tools=tools,
        tool_choice=choice,
        text=req.text if req.text is not None else TextConfig(format=TextFormat(type="text")),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        reasoning=req.reasoning,
        truncation=req.truncation or "disabled",
        metadata=req.metadata,
        user=req.user,
        completed_at=int(time.time()) if status == "completed" else None,
    )


def responses_response(ctx: ServingContext, plan: ResponsesPlan, outs: Sequence[RequestOutput]) -> ResponseObject:
    """The `response` object of a finished request, built from the chat pipeline's answer (tool calls and
    reasoning are parsed there)."""
    chat = chat_response(ctx, plan.chat_req, plan.chat, outs)
    (choice,) = chat.choices
    msg = choice.message
    logprobs = (choice.logprobs.content or []) if choice.logprobs is not None else []
    status, error = outcome(outs[0].outputs[0].finish_reason)
    output = output_items(msg.reasoning_content, msg.content, msg.tool_calls, logprobs, status == "completed")
    use = response_usage(ctx, chat.usage or UsageInfo(), msg.reasoning_content)
    return response_object(plan, ctx.model_name, output, status, use, error)


# ---------------------------------------------------------------------------------------------------- streamed
class EventWriter:
    """The event sequence of one answer. Items open as their first delta arrives (reasoning, message text, each
    function call) and close when another kind starts or the answer ends; `items` holds them closed, as the final
    response lists them."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.text: list[str] = []  # the open reasoning's or message's text, or the open call's arguments
        self.logprobs: list[ChatLogprobEntry] = []
        self.call_index: int | None = None  # the open call's index in the streamed tool_calls

    def event(self, model: type, type: str, **fields: Any) -> str:
        ev = model(type=type, sequence_number=self.seq, **fields)
        self.seq += 1
        return f"event: {type}\ndata: {ev.model_dump_json(by_alias=True)}\n\n"

    def lifecycle(self, type: str, response: ResponseObject) -> str:
        return self.event(ResponseLifecycleEvent, type, response=response)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": len(self.items)}

    def _start(self, item: OutputItem, part: OutputText | ReasoningText | None) -> list[str]:
        self.open, self.text, self.logprobs = item, [], []
        out = [self.event(OutputItemEvent, "response.output_item.added", output_index=len(self.items), item=item)]
        if part is not None:
            out.append(
                self.event(ContentPartEvent, "response.content_part.added", content_index=0, part=part, **self._where())
            )
        return out

    def close(self, status: ItemStatus = "completed") -> list[str]:
        """Close the open item (if any) with its done events."""
        item, text = self.open, "".join(self.text)
        if item is None:
            return []
        where = self._where()
        if isinstance(item, OutputFunctionCall):
            item = item.model_copy(update={"arguments": text, "status": status})
            out = [
                self.event(
                    ArgumentsDoneEvent, "response.function_call_arguments.done", name=item.name, arguments=text, **where
                )
            ]
        elif isinstance(item, OutputReasoning):
            item = reasoning_item(text, status, item.id)
            out = [
                self.event(TextDoneEvent, "response.reasoning_text.done", content_index=0, text=text, **where),
                self.event(
                    ContentPartEvent, "response.content_part.done", content_index=0, part=item.content[0], **where
                ),
            ]
        else:
            item = message_item(text, status, self.logprobs, item.id)
            done = "response.output_text.done"
            out = [
                self.event(TextDoneEvent, done, content_index=0, text=text, logprobs=self.logprobs, **where),
                self.event(
                    ContentPartEvent, "response.content_part.done", content_index=0, part=item.content[0], **where
                ),
            ]
        out.append(self.event(OutputItemEvent, "response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open, self.call_index = None, None
        return out

    def reasoning(self, delta: str) -> list[str]:
        out = []
        if not isinstance(self.open, OutputReasoning):
            out += self.close()
            out += self._start(OutputReasoning(id=_id("rs"), content=[], status="in_progress"), ReasoningText(text=""))
        self.text.append(delta)
        out.append(
            self.event(TextDeltaEvent, "response.reasoning_text.delta", content_index=0, delta=delta, **self._where())
        )
        return out

    def message(self, delta: str, logprobs: list[ChatLogprobEntry]) -> list[str]:
        out = []
        if not isinstance(self.open, OutputMessage):
            out += self.close()
            out += self._start(OutputMessage(id=_id("msg"), status="in_progress", content=[]), OutputText(text=""))
        self.text.append(delta)
        self.logprobs += logprobs
        out.append(
            self.event(
                TextDeltaEvent,
                "response.output_text.delta",
                content_index=0,
                delta=delta,
                logprobs=logprobs,
                **self._where(),
            )
        )
        return out

    def tool_call(self, d: DeltaToolCall) -> list[str]:
        out = []
        fn = d.function
        if d.index != self.call_index:
            out += self.close()
            call = ToolCall(
                id=d.id or _id("call"), function=FunctionCall(name=(fn.name if fn else None) or "", arguments="")
            )
            out += self._start(function_call_item(call, "in_progress"), None)
            self.call_index = d.index
        if fn is not None and fn.arguments:
            self.text.append(fn.arguments)
            out.append(
                self.event(
                    ArgumentsDeltaEvent, "response.function_call_arguments.delta", delta=fn.arguments, **self._where()
                )
            )
        return out

    def finish(self, status: ItemStatus) -> list[str]:
        """Close the last item with `status`; an answer with no item at all gets its (empty) message."""
        out = []
        if self.open is None and not self.items:
            out += self._start(OutputMessage(id=_id("msg"), status="in_progress", content=[]), OutputText(text=""))
        return out + self.close(status)


def _failure(e: BaseException, gen: Generation) -> ResponseError:
    status, message = stream_failure(e, gen.metrics)
    return ResponseError(code="invalid_prompt" if status == 400 else "server_error", message=message)


async def responses_stream(
    ctx: ServingContext, plan: ResponsesPlan, gen: Generation, first: tuple[int, RequestOutput] | None, rest
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response; an engine failure ends it with response.failed."""
    w = EventWriter()
    k = plan.chat.num_logprobs
    reader = plan.chat.output.choice()
    sent_lp = 0
    lps: list[ChatLogprobEntry] = []  # logprobs of tokens whose text has not been streamed yet
    reasoning: list[str] = []
    status: ResponseStatus = "completed"
    error: ResponseError | None = None
    yield w.lifecycle("response.created", response_object(plan, ctx.model_name, [], "in_progress"))
    yield w.lifecycle("response.in_progress", response_object(plan, ctx.model_name, [], "in_progress"))
    try:
        async for _, out in output_events(first, rest):
            (o,) = out.outputs
            if k is not None and o.logprobs is not None:
                lps += chat_logprobs(o.logprobs[sent_lp:], ctx.tokens, k)
                sent_lp = len(o.logprobs)
            # the reader may hold text back (a tag in the making) until it decides what it is
            d = (reader.finish if o.finish_reason is not None else reader.feed)(o.delta_text)
            if d is not None:
                if d.reasoning_content:
                    reasoning.append(d.reasoning_content)
                    for ev in w.reasoning(d.reasoning_content):
                        yield ev
                if d.content:
                    for ev in w.message(d.content, lps):
                        yield ev
                    lps = []
                for t in d.tool_calls or ():
                    for ev in w.tool_call(t):
                        yield ev
            if o.finish_reason is not None:
                status, error = outcome(o.finish_reason)
        if isinstance(w.open, OutputMessage):
            w.logprobs += lps  # tokens without text of their own (the end-of-sequence token)
        for ev in w.finish("completed" if status == "completed" else "incomplete"):
            yield ev
        use = response_usage(ctx, usage(gen.last), "".join(reasoning) or None)
        final = response_object(plan, ctx.model_name, w.items, status, use, error)
        yield w.lifecycle(f"response.{status}", final)
    except Exception as e:  # the engine failed mid-stream: the response fails in-band
        failed = response_object(plan, ctx.model_name, w.items, "failed", error=_failure(e, gen))
        yield w.lifecycle("response.failed", failed)
    finally:
        gen.close()
