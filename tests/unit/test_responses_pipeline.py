"""The Responses API pipeline without a server: input items become the chat request they mean (instructions first,
function calls of one answer in one assistant turn, their outputs as role tool, reasoning on the next assistant
turn), chat errors are renamed to the Responses fields, and the streamed events of an answer with reasoning, text and
two function calls parse as the openai SDK's events and rebuild the same output items as the whole response."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from netra_jax.serving.errors import APIError
from netra_jax.serving.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from netra_jax.serving.protocol_responses import ResponsesRequest
from netra_jax.serving.responses_input import Origins, chat_request, remap_error
from netra_jax.serving.responses_output import EventWriter, outcome, output_items, response_object

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}, "strict": True}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps(body))


def test_items_become_chat_messages():
    req = _req(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "m",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"tz": "UTC"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        ],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"},
        max_output_tokens=7,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    )
    chat, where = chat_request(req)
    got = [(m.role, m.content, m.tool_call_id, m.name) for m in chat.messages]
    assert got == [
        ("system", "Be brief.", None, None),
        ("developer", "Use tools.", None, None),
        ("user", "Weather ?", None, None),
        ("assistant", "Checking.", None, None),
        ("tool", "sunny", "c1", "get_weather"),
        ("tool", "noon", "c2", "get_time"),
    ]
    assert where.messages == ["instructions", "input.0", "input.1", "input.3", "input.6", "input.7"]
    assert where.calls[3] == ["input.4", "input.5"]
    turn = chat.messages[3]
    assert turn.reasoning_content == "hm"
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls] == [
        ("c1", "get_weather", "{}"),
        ("c2", "get_time", '{"tz": "UTC"}'),
    ]
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.strict is True
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format is None  # a forced call writes no text for text.format to shape
    free, _ = chat_request(req.model_copy(update={"tool_choice": "auto"}))
    assert free.response_format.type == "json_schema"
    assert free.response_format.json_schema.json_schema == {"type": "object"}
    assert chat.max_completion_tokens == 7 and chat.logprobs and chat.top_logprobs == 3
    assert chat.reasoning_effort == "low"


def test_a_call_without_a_preceding_answer_opens_an_assistant_turn():
    chat, where = chat_request(_req(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    (m,) = chat.messages
    assert m.role == "assistant" and m.content is None and m.tool_calls[0].id == "c"
    assert where.messages == ["input.0"] and where.calls == [["input.0"]]
    chat, _ = chat_request(_req(input="hello"))
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hello")]
    assert chat.tools is None and chat.tool_choice is None and not chat.logprobs


def test_chat_errors_name_the_responses_fields():
    where = Origins(["instructions", "input.0", "input.2"], [[], [], ["input.2", "input.3"]])
    e = remap_error(APIError(400, "messages[2]: content is required", "messages.2.content"), where)
    assert (e.message, e.param) == ("input.2: content is required", "input.2")
    e = remap_error(
        APIError(
            400,
            "messages[2].tool_calls[1].function.arguments is not valid JSON",
            "messages.2.tool_calls.1.function.arguments",
        ),
        where,
    )
    assert (e.message, e.param) == ("input.3.arguments is not valid JSON", "input.3.arguments")
    e = remap_error(APIError(400, "max_completion_tokens (9) is too many", "max_completion_tokens"), where)
    assert (e.message, e.param) == ("max_output_tokens (9) is too many", "max_output_tokens")
    e = remap_error(APIError(400, "bad schema", "tools.1.function.parameters"), where)
    assert e.param == "tools.1.parameters"
    e = remap_error(APIError(400, "response_format: no", "response_format", "invalid_response_format"), where)
    assert (e.message, e.param, e.code) == ("text.format: no", "text.format", "invalid_response_format")


def _call(index: int, *pieces: str, name: str = "get_weather") -> list[DeltaToolCall]:
    first = DeltaToolCall(index=index, id=f"call_{index}", type="function", function=DeltaFunctionCall(name=name))
    return [first] + [DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=p)) for p in pieces]


def test_streamed_events_rebuild_the_whole_output():
    plan_req = _req(input="hi", tools=[TOOL])
    w = EventWriter()
    sse = []
    for piece in ("think", "ing"):
        sse += w.reasoning(piece)
    for piece in ("It is ", "sunny."):
        sse += w.message(piece, [])
    for d in _call(0, '{"city": ', '"Oslo"}') + _call(1, "{}", name="get_time"):
        sse += w.tool_call(d)
    sse += w.finish("completed")
    events = []
    for frame in sse:
        head, data = frame.strip().split("\n")
        ev = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {ev.type}"
        events.append(ev)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2, 3]
    calls = [
        ToolCall(id="call_0", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}')),
        ToolCall(id="call_1", function=FunctionCall(name="get_time", arguments="{}")),
    ]
    whole = output_items("thinking", "It is sunny.", calls, [], done=True)
    strip = {"id"}
    assert [i.model_dump(exclude=strip) for i in w.items] == [i.model_dump(exclude=strip) for i in whole]

    params = SimpleNamespace(temperature=1.0, top_p=1.0)
    plan = SimpleNamespace(
        id="resp_x", created_at=0, req=plan_req, chat=SimpleNamespace(num_logprobs=None, params=params)
    )
    obj = response_object(plan, "m", w.items, "completed")
    sdk = Response.model_validate(obj.model_dump(mode="json", by_alias=True))
    assert [i.type for i in sdk.output] == ["reasoning", "message", "function_call", "function_call"]
    assert sdk.output[2].arguments == '{"city": "Oslo"}' and sdk.output[3].call_id == "call_1"
    assert sdk.output[0].content[0].text == "thinking" and sdk.output_text == "It is sunny."
    assert sdk.tool_choice == "auto" and sdk.tools[0].name == "get_weather"


def test_an_empty_answer_has_its_message_and_a_cut_one_is_incomplete():
    w = EventWriter()
    types = [json.loads(f.split("data: ")[1])["type"] for f in w.finish("incomplete")]
    assert types == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [(i.type, i.status, i.content[0].text) for i in w.items] == [("message", "incomplete", "")]
    items = output_items(None, "", [], [], done=False)
    assert [(i.type, i.status) for i in items] == [("message", "incomplete")]
    w = EventWriter()
    w.reasoning("cut short")
    w.finish("incomplete")
    whole = output_items("cut short", None, [], [], done=False)
    assert [(i.type, i.status, i.content[0].text) for i in w.items] == [("reasoning", "incomplete", "cut short")]
    assert [i.model_dump(exclude={"id"}) for i in whole] == [i.model_dump(exclude={"id"}) for i in w.items]


def test_an_engine_failure_mid_stream_fails_the_response():
    """After a first text delta the engine dies: the stream ends with response.failed carrying the error and the
    item written so far, and the Generation is closed."""
    from netra_jax.engine.async_engine import EngineDeadError
    from netra_jax.engine.outputs import CompletionOutput, RequestOutput
    from netra_jax.serving.chat_output import ChatOutput
    from netra_jax.serving.responses_output import responses_stream
    from netra_jax.serving.tool_choice import ToolChoicePlan

    closed = []
    params = SimpleNamespace(temperature=1.0, top_p=1.0)
    chat = SimpleNamespace(num_logprobs=None, params=params, output=ChatOutput(ToolChoicePlan("none")))
    plan = SimpleNamespace(id="resp_x", created_at=0, req=_req(input="hi"), chat=chat)
    gen = SimpleNamespace(metrics=None, last=[None], close=lambda: closed.append(True))
    first = (0, RequestOutput("r", None, [1], [CompletionOutput(0, "Hel", [5], delta_text="Hel")]))

    async def rest():
        raise EngineDeadError("the device fell over")
        yield

    async def collect():
        ctx = SimpleNamespace(model_name="m")
        return [frame async for frame in responses_stream(ctx, plan, gen, first, rest())]

    events = [EVENTS.validate_python(json.loads(f.split("data: ", 1)[1])) for f in asyncio.run(collect())]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "the device fell over" in failed.error.message and closed == [True]
    assert outcome("stop") == ("completed", None) and outcome("length") == ("incomplete", None)
    status, error = outcome("error")  # an output constraint that allowed no token
    assert status == "failed" and error.code == "server_error" and "error" in error.message
