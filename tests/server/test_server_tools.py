"""Tool calling and reasoning through a real `netra-jax serve` process (tiny-qwen3, a Qwen-style tool template, the
hermes and qwen3 parsers), driven by real clients: the openai SDK (named, required and auto tool choice, streamed
calls rebuilt by the SDK's own stream accumulator, tool-call history, reasoning_content), LangChain (bind_tools,
with_structured_output(method="function_calling")) and instructor's TOOLS mode. The model has random weights: the
grammar of "required" / a named function makes its calls valid, and for "auto" (where nothing constrains a model
that would never call a tool by itself) vLLM's structured_outputs regex writes a <tool_call> for the parser to find."""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, ConfigDict, Field
from support.checkpoints import REPO
from support.server import MODEL, openai_client, running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no client library may reach the network (tiktoken, hub)
os.environ.setdefault("TIKTOKEN_CACHE_DIR", tempfile.mkdtemp(prefix="tiktoken-empty-"))

TEMPLATE = REPO / "tests" / "fixtures" / "templates" / "qwen3_tools.jinja"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": WEATHER_PARAMS}}
CLOCK_PARAMS = {
    "type": "object",
    "properties": {"tz": {"enum": ["utc", "cet"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": CLOCK_PARAMS}}
SCHEMAS = {"weather": WEATHER_PARAMS, "clock": CLOCK_PARAMS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CLOCK_TEXT = '<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--max-num-seqs",
        "4",
        "--num-kv-pages",
        "160",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 96, **kw})


def streamed(client, **kw):
    """The completion the SDK's own accumulator rebuilds from the chunks, and the chunks."""
    state = ChatCompletionStreamState()
    chunks = list(
        client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 96, **kw}, stream=True)
    )
    for c in chunks:
        state.handle_chunk(c)
    return state.get_final_completion(), chunks


def calls(message) -> list[tuple[str, dict]]:
    out = []
    for c in message.tool_calls or []:
        assert c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])  # the grammar kept the arguments valid
        out.append((c.function.name, args))
    return out


def test_named_tool_choice(client):
    choice = {"type": "function", "function": {"name": "weather"}}
    r = chat(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice)
    msg = r.choices[0].message
    assert [name for name, _ in calls(msg)] == ["weather"] and msg.content is None
    assert r.choices[0].finish_reason == "stop"  # a forced function ends with "stop", as OpenAI and vLLM answer
    final, chunks = streamed(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert calls(final.choices[0].message) == calls(msg)
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = pieces[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "weather"
    assert len(pieces) > 2 and all(p.id is None and p.function.name is None for p in pieces[1:])  # arguments grow


def test_required_tool_choice(client):
    """One call at least, of any offered tool (one exactly with parallel_tool_calls=false): finish_reason
    "tool_calls". A random model given room for more calls keeps writing them; the first is whole and valid."""
    one = {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False}
    r = chat(client, **one)
    got = calls(r.choices[0].message)
    assert len(got) == 1 and r.choices[0].finish_reason == "tool_calls"
    final, _ = streamed(client, **one)
    assert calls(final.choices[0].message) == got and final.choices[0].finish_reason == "tool_calls"
    many = chat(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=64)
    first = many.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(first.function.arguments), SCHEMAS[first.function.name])


def test_auto_tool_choice_parses_the_models_text(client):
    """tool_choice absent with tools is "auto": the hermes parser reads <tool_call> out of the text (forced by a
    regex here), non-streamed and streamed, with the thinking before it in reasoning_content."""
    text = "<think>\nA tool.\n</think>\n\nOk." + CALL_TEXT + "\n" + CLOCK_TEXT
    extra = {"structured_outputs": {"regex": re.escape(text)}}
    r = chat(client, messages=ASK, tools=[WEATHER, CLOCK], extra_body=extra, max_tokens=148)
    msg = r.choices[0].message
    assert calls(msg) == [("weather", {"city": "Oslo", "days": 2}), ("clock", {"tz": "utc"})]
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "\n\nOk." and msg.reasoning_content == "\nA tool.\n"
    final, chunks = streamed(
        client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="auto", extra_body=extra, max_tokens=148
    )
    assert calls(final.choices[0].message) == calls(msg) and final.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content  # no piece of a tag leaks into content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    none = chat(
        client,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",
        extra_body={"structured_outputs": {"regex": re.escape(CALL_TEXT)}},
    )
    assert none.choices[0].message.content == CALL_TEXT and not none.choices[0].message.tool_calls


def test_tool_history_and_template_kwargs(server, client):
    """Earlier calls (arguments as JSON text) and tool results render through the template, arguments as an
    object; chat_template_kwargs={"enable_thinking": false} reaches the template; bad history is a 400."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Paris","days":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
    ]
    r = chat(
        client,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=4,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": r.model_extra["prompt_token_ids"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C\n</tool_response>" in prompt and '"name": "weather"' in prompt.split("</tools>")[0]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city": '
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=history, tools=[WEATHER], max_tokens=4)
    assert e.value.body["param"] == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param


class Weather(BaseModel):
    """Weather for a city."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=5)


class Clock(BaseModel):
    """Time."""

    model_config = ConfigDict(extra="forbid")
    tz: Literal["utc", "cet"]


class Person(BaseModel):
    """A person."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)


def test_langchain(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=64, max_retries=0
    )
    ai = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    (call,) = ai.tool_calls
    assert call["name"] == "Weather" and Weather(**call["args"]) and call["id"].startswith("call_")
    ai = llm.bind_tools([Weather, Clock], tool_choice="any", parallel_tool_calls=False).invoke("Weather?")  # required
    assert ai.tool_calls and ai.response_metadata["finish_reason"] == "tool_calls"
    person = llm.with_structured_output(Person, method="function_calling").invoke("Describe a person.")
    assert isinstance(person, Person)


def test_instructor_tools_mode(server):
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), mode=instructor.Mode.TOOLS
    )
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=96,
        temperature=0,
        max_retries=1,
    )
    assert isinstance(person, Person)


def test_reasoning_without_tools(client):
    text = "<think>\nshort\n</think>\n\nHi."
    r = chat(client, messages=ASK, extra_body={"structured_outputs": {"regex": re.escape(text)}})
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("\nshort\n", "\n\nHi.", "stop")


def test_tokenize_renders_messages_as_the_chat_route(server):
    """/tokenize with messages takes the chat route's template fields (tools, chat_template_kwargs,
    continue_final_message) and counts exactly the prompt the chat route runs."""
    history = [*ASK, {"role": "assistant", "content": "Let me"}]
    for kw in (
        {"tools": [WEATHER, CLOCK]},
        {"tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": history, "continue_final_message": True, "add_generation_prompt": False},
    ):
        body = {"messages": ASK, **kw}
        extra = {"tool_choice": "none"} if "tools" in body else {}
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**body, **extra, "max_tokens": 1, "return_token_ids": True}
        )
        tok = httpx.post(server.url + "/tokenize", json=body)
        assert r.status_code == tok.status_code == 200, (r.text, tok.text)
        assert tok.json()["tokens"] == r.json()["prompt_token_ids"], kw
    plain = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()["tokens"]
    assert len(with_tools) > len(plain)  # the template rendered the tool list
    bad = httpx.post(server.url + "/tokenize", json={"messages": ASK, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
