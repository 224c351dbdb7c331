"""Request bodies for the Responses API tests (tests/server/test_server_responses.py): a conversation in both APIs'
shapes, function tools, the table of refused bodies with the field each must name, and generated bodies (input items
and parts of every kind, tools, tool choices, formats, edge values)."""

from __future__ import annotations

from hypothesis import strategies as st
from support.schemas import SCHEMA

TURNS = [
    {"role": "user", "content": [{"type": "input_text", "text": "Name a pet."}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "A cat.", "annotations": []}]},
    {"role": "user", "content": "And another one?"},
]
CHAT_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a pet."},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And another one?"},
]
FORMAT = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}, "required": ["tz"], "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "A city's weather",
        "parameters": WEATHER,
        "strict": True,
    },
    {"type": "function", "name": "get_time", "parameters": TIME},
]

# the fields each body must be refused for (400; the model: 404)
BAD = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools.0.bogus"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "7"}]}, "input.0.call_id"),
    (
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "d", "output": "7"},
            ]
        },
        "input.2.call_id",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]},
        "input.0.arguments",
    ),
    (
        {
            "input": [
                {"role": "assistant", "content": "Calling."},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "d", "name": "f", "arguments": "[1]"},
            ]
        },
        "input.2.arguments",
    ),
    ({"input": [3]}, "input.0"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi " * 2000}, "input"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_logprobs": 50, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_token": 5}, "max_output_token"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"model": "other", "input": "hi"}, "model"),
    ({}, "input"),
]

# generated bodies: max_output_tokens always given and small, so valid bodies generate a few tokens at most
_text = st.one_of(st.text(max_size=8), st.sampled_from(["", "\x00", "é中😀", "{{ 7 * 7 }}", "<tool_call>"]))
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "text", "x"])},
    optional={"text": st.one_of(_text, st.none(), st.integers()), "refusal": _text},
)
_content = st.one_of(_text, st.lists(_part, max_size=3), st.none())
_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]), "content": _content},
        optional={"type": st.sampled_from(["message", "msg"]), "id": _text, "status": _text},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": _text,
            "name": _text,
            "arguments": st.one_of(_text, st.just("{}")),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _text, "output": st.one_of(_content, st.integers())}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")}, optional={"summary": st.lists(_part, max_size=2), "content": _content}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", ""])}),
    st.integers(),
)
_tool = st.one_of(
    st.just(TOOLS[1]),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]), "name": _text},
        optional={"parameters": st.one_of(st.just(TIME), st.dictionaries(_text, st.integers(), max_size=2))},
    ),
)
_fields = {
    "instructions": st.one_of(_text, st.none()),
    "temperature": st.one_of(st.floats(-1, 3), st.none()),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.none()),
    "top_logprobs": st.integers(-1, 30),
    "include": st.lists(
        st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", ""]), max_size=2
    ),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", "any"]),
        st.fixed_dictionaries({"type": st.sampled_from(["function", "mcp"]), "name": _text}),
    ),
    "text": st.fixed_dictionaries(
        {"format": st.one_of(st.just({"type": "json_object"}), st.just(FORMAT), st.just({"type": "json_schema"}))}
    ),
    "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["low", "high", "max"])}),
    "stream": st.booleans(),
    "store": st.booleans(),
    "metadata": st.dictionaries(_text, st.one_of(_text, st.integers()), max_size=2),
    "previous_response_id": _text,
    "seed": st.one_of(st.integers(-2, 5), st.just(2**64)),
    "parallel_tool_calls": st.booleans(),
}
BODIES = st.fixed_dictionaries(
    {
        "input": st.one_of(_text, st.lists(_item, max_size=4)),
        "max_output_tokens": st.one_of(st.integers(1, 3), st.sampled_from([-2, 0, 10**30])),  # never unbounded
    },
    optional=_fields,
)
