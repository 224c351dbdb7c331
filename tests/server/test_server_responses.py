"""POST /v1/responses on a real `netra-jax serve` process (tiny-qwen3), driven by the openai SDK's responses.create and
the OpenAI Agents SDK: text and message-list input with instructions give the chat route's greedy text and token
counts, max_output_tokens makes the response incomplete, text.format json_schema output fits its schema, streamed
events rebuild the same response, reasoning and forced function calls become their items, a function_call_output
turn is the chat route's tool history, and stateful, unsupported or malformed bodies are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, Field
from support.checkpoints import REPO
from support.responses_cases import BAD, BODIES, CHAT_TURNS, FORMAT, TOOLS, TURNS
from support.schemas import check_schema
from support.server import MODEL, openai_client, running_server


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "128",
        "--num-kv-pages",
        "64",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(REPO / "tests" / "fixtures" / "templates" / "chatml_thinking.jinja"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, messages, n: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)


def _message_text(r) -> str:
    (item,) = [i for i in r.output if i.type == "message"]
    assert item.role == "assistant" and [p.type for p in item.content] == ["output_text"]
    assert item.content[0].annotations == []
    return item.content[0].text


def _counts(usage) -> tuple[int, int, int, int]:
    """Token counts of a usage (cached_tokens left out: a repeated prompt may hit the prefix cache)."""
    return usage.input_tokens, usage.output_tokens, usage.total_tokens, usage.output_tokens_details.reasoning_tokens


def _without_ids(items) -> list[dict]:
    return [i.model_dump(exclude={"id", "call_id"}) for i in items]


def test_text_input_is_the_chat_answer_and_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Name a pet.", max_output_tokens=8, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "Name a pet."}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert _message_text(r) == r.output_text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"  # the random model does not stop within 8 tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 8
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens >= 0
    assert r.temperature == 0 and r.top_p == 1 and r.tools == [] and r.tool_choice == "none"
    assert r.text.format.type == "text" and r.parallel_tool_calls is True
    assert r.model_extra["store"] is False  # answered, not kept


def test_message_list_with_instructions_is_the_chat_conversation(client):
    r = client.responses.create(
        model=MODEL, input=TURNS, instructions="Answer briefly.", max_output_tokens=10, temperature=0
    )
    chat = _chat(client, CHAT_TURNS, 10)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # the instructions are the system message
    assert r.instructions == "Answer briefly."
    without = client.responses.create(model=MODEL, input=TURNS, max_output_tokens=1, temperature=0)
    assert without.usage.input_tokens < r.usage.input_tokens


def test_text_format_json_schema_and_json_object(client):
    r = client.responses.create(
        model=MODEL, input="Describe a person.", max_output_tokens=128, temperature=0, text={"format": FORMAT}
    )
    assert r.status == "completed" and r.incomplete_details is None
    check_schema(json.loads(r.output_text))
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = client.responses.create(
        model=MODEL,
        input="Any JSON.",
        max_output_tokens=64,
        temperature=0.8,
        top_p=0.9,
        text={"format": {"type": "json_object"}},
        extra_body={"seed": 3},
    )
    if r.status == "completed":  # sampled: the object may not close within 64 tokens
        assert isinstance(json.loads(r.output_text), dict)
    assert r.temperature == pytest.approx(0.8) and r.top_p == pytest.approx(0.9)


def test_streaming_event_sequence_rebuilds_the_response(client):
    kw = dict(model=MODEL, input=TURNS, instructions="Answer briefly.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events[2:-1])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-2].item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "incomplete"
    assert final.output_text == whole.output_text and final.output[0].id == item_id
    assert _counts(final.usage) == _counts(whole.usage)


def test_output_text_logprobs_are_the_chat_logprobs(client):
    kw = dict(model=MODEL, input="Name a pet.", max_output_tokens=5, temperature=0)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a pet."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(x.token, x.logprob, len(x.top_logprobs)) for x in got] == [
        (x.token, x.logprob, len(x.top_logprobs)) for x in want
    ]
    events = list(client.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=2, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in got]


def test_reasoning_is_a_reasoning_item_whole_and_streamed(client):
    """The template's thinking prompt opens a <think> block that the random model never closes: with the qwen3
    reasoning parser the whole answer is reasoning, cut at max_output_tokens."""
    thinking = {"chat_template_kwargs": {"thinking": True}}
    kw = dict(model=MODEL, input="Why?", max_output_tokens=8, temperature=0, extra_body=thinking)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Why?"}], max_tokens=8, temperature=0, extra_body=thinking
    )
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    assert thought and chat.choices[0].message.content is None
    assert [(i.type, i.status) for i in r.output] == [("reasoning", "incomplete")] and r.output_text == ""
    assert r.output[0].content[0].text == thought and r.output[0].summary == []
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    deltas = types.count("response.reasoning_text.delta")
    assert deltas >= 1 and types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    final = events[-1].response
    assert _without_ids(final.output) == _without_ids(r.output) and _counts(final.usage) == _counts(r.usage)


# ---------------------------------------------------------------------------------------------------- tools
def _check_call(item) -> None:
    args = json.loads(item.arguments)
    if item.name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("c", "f"), args
    else:
        assert item.name == "get_time" and args == {"tz": "UTC"}, args
    assert item.call_id and item.id.startswith("fc_") and item.status == "completed"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_function_calls_whole_and_streamed(client, choice):
    kw = dict(model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice=choice, max_output_tokens=100)
    r = client.responses.create(temperature=0, **kw)
    assert r.status == "completed" and r.output and {i.type for i in r.output} == {"function_call"}
    for item in r.output:
        _check_call(item)
    if choice != "required":
        assert [i.name for i in r.output] == ["get_time"] and r.tool_choice.name == "get_time"
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    events = list(client.responses.create(stream=True, temperature=0, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    per_call = []
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.item.type == "function_call" and e.item.arguments == "" and e.item.status == "in_progress"
            per_call.append([e.type])
        else:
            per_call[-1].append(e.type)
            assert e.output_index == len(per_call) - 1
    for types in per_call:
        assert types[0] == "response.output_item.added" and set(types[1:-2]) == {
            "response.function_call_arguments.delta"
        }
        assert types[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(args) == "".join(i.arguments for i in r.output)
    assert events[-1].type == "response.completed"
    assert _without_ids(events[-1].response.output) == _without_ids(r.output)
    sampled = client.responses.create(temperature=1.0, top_p=0.95, extra_body={"seed": 7}, **kw)
    for item in sampled.output:
        _check_call(item)


def test_function_call_output_turn_is_the_chat_tool_history(client):
    first = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=100
    )
    calls = [i for i in first.output if i.type == "function_call"]
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"result {k}"} for k, c in enumerate(calls)
    ]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        *[i.model_dump(exclude_none=True) for i in first.output],
    ]
    r = client.responses.create(model=MODEL, input=history + outputs, tools=TOOLS, temperature=0, max_output_tokens=10)
    assert r.tool_choice == "auto" and r.output_text  # auto: the hermes parser finds no call in this text
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
        *[{"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]} for o in outputs],
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[{"type": "function", "function": _flat(t)} for t in TOOLS],
        max_tokens=10,
        temperature=0,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content


def _flat(tool: dict) -> dict:
    return {k: v for k, v in tool.items() if k != "type"}


# ---------------------------------------------------------------------------------------------------- Agents SDK
class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=99)


def test_agents_sdk_default_responses_model_runs_a_turn(server):
    """The Agents SDK's default model (OpenAIResponsesModel on the default client), whole and streamed; a typed
    output makes the random model's answer end (its text.format grammar closes the JSON)."""
    import agents  # the OpenAI Agents SDK (dev extra); imported here, its import takes seconds

    agents.set_tracing_disabled(True)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api("responses")
        settings = agents.ModelSettings(temperature=0, max_tokens=64)
        agent = agents.Agent(
            name="pets", instructions="Describe a pet.", model=MODEL, output_type=Pet, model_settings=settings
        )
        whole = await agents.Runner.run(agent, "Which pet?")
        streamed = agents.Runner.run_streamed(agent, "Which pet?")
        kinds = [e.type async for e in streamed.stream_events()]
        return whole, streamed, kinds

    whole, streamed, kinds = asyncio.run(run())
    assert isinstance(whole.final_output, Pet) and streamed.final_output == whole.final_output
    (raw,) = whole.raw_responses
    assert raw.usage.input_tokens > 0 and raw.usage.output_tokens > 0
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_agents_sdk_forced_tool_then_answer(server):
    """tool_choice "required" makes the first turn call the tool; the SDK then resets the choice to "auto", the
    server's hermes parser finds no call in the next (typed) answer, and the run ends with it."""
    import agents  # the OpenAI Agents SDK (dev extra); imported here, its import takes seconds

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def pet_age(kind: Literal["cat", "dog"]) -> str:
        """How old the pet is."""
        seen.append(kind)
        return "7"

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(MODEL, openai_client=client)
        settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64)
        agent = agents.Agent(
            name="pets",
            instructions="Use the tool.",
            model=model,
            tools=[pet_age],
            output_type=Pet,
            model_settings=settings,
        )
        return await agents.Runner.run(agent, "How old is the pet?", max_turns=4)

    result = asyncio.run(run())
    assert len(seen) >= 1 and set(seen) <= {"cat", "dog"}
    assert isinstance(result.final_output, Pet) and len(result.raw_responses) == 2
    first, last = result.raw_responses
    assert {i.type for i in first.output} == {"function_call"} and [i.type for i in last.output] == ["message"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == ["7"] * len(seen)


# ---------------------------------------------------------------------------------------------------- refused
def test_refused_requests_name_the_field(server, client):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in BAD:
            r = http.post("/v1/responses", json=body)
            case = str(body)[:200]
            assert r.status_code == (404 if param == "model" else 400), f"{case}: {r.status_code} {r.text}"
            err = r.json()["error"]
            assert err["param"] == param and err["message"], f"{case}: {err}"
        for raw in (b"", b"[]", b'{"input": "hi",', b"null"):
            r = http.post("/v1/responses", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, raw
        for method, path in [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1")]:
            r = http.request(method, path)
            assert r.status_code == 404 and "keeps no responses" in r.json()["error"]["message"]
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, store=True, metadata={"k": "v"})
    assert r.model_extra["store"] is False and r.metadata == {"k": "v"}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ---------------------------------------------------------------------------------------------------- generated
def test_generated_bodies_get_no_server_error(server):
    """Generated bodies (input items, parts, tools, choices, formats, edge values): each is answered below 500,
    a refusal with the error envelope, a stream with a terminal event."""
    tally = {"2xx": 0, "4xx": 0}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(body=BODIES)
    def run(body):
        if body.get("stream") is True:
            with http.stream("POST", "/v1/responses", json=body) as r:
                text = "\n".join(r.iter_lines())
            if r.status_code == 200:
                last = json.loads(text.rsplit("data: ", 1)[1])
                assert last["type"] in ("response.completed", "response.incomplete"), last
        else:
            r = http.post("/v1/responses", json=body)
            text = r.text
        assert r.status_code < 500, f"{body!r}: {r.status_code} {text[:500]}"
        if r.status_code >= 400:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        tally[f"{r.status_code // 100}xx"] += 1

    with httpx.Client(base_url=server.url, timeout=120) as http:
        run()
        assert http.get("/health").status_code == 200
    assert tally["2xx"] > 0 and tally["4xx"] > 0, tally
