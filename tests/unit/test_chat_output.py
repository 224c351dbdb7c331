"""tool_choice planning (vLLM's defaults and 400s naming the field), the grammars of "required" and a named function
checked with llguidance on a real tokenizer, chat messages as the template reads them, and one choice's reading
(reasoning, then tool calls, then content) whole and streamed, with its finish_reason."""

from __future__ import annotations

import json
import re

import pytest
import tokenizers
from support.checkpoints import FIXTURES
from tokenizers import AddedToken

from netra_jax.sampling_params import SamplingParams, StructuredOutputsParams
from netra_jax.serving.chat_messages import chat_messages, template_tools
from netra_jax.serving.chat_output import ChatOutput, ChatOutputConfig
from netra_jax.serving.errors import APIError
from netra_jax.serving.protocol import ChatCompletionRequest
from netra_jax.serving.tool_choice import AUTO_NEEDS_FLAGS, apply_tool_grammar, plan_tool_choice
from netra_jax.serving.tool_parsers import assemble
from netra_jax.structured_output import StructuredOutputs
from netra_jax.tokenization.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city", "unit"],
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: the empty object


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_hf_dir(FIXTURES / "tiny-qwen3")


def accepts(tok: Tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    m = StructuredOutputs(tok, 512).matcher(spec)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.matcher.is_accepting()


# ---------------------------------------------------------------------------------------------------- planning
def test_defaults_follow_vllm():
    assert plan_tool_choice(request(), auto_enabled=False).mode == "none"
    assert plan_tool_choice(request(tools=[WEATHER]), auto_enabled=True).mode == "auto"
    with pytest.raises(APIError) as e:  # tools without tool_choice mean "auto", which needs the server's flags
        plan_tool_choice(request(tools=[WEATHER]), auto_enabled=False)
    assert (e.value.status, e.value.param, e.value.message) == (400, "tool_choice", AUTO_NEEDS_FLAGS)
    none = plan_tool_choice(request(tools=[WEATHER], tool_choice="none"), auto_enabled=False)
    assert none.mode == "none" and none.tools is not None  # still shown to the template, as vLLM does
    hidden = plan_tool_choice(request(tools=[WEATHER], tool_choice="none"), False, exclude_tools_when_none=True)
    assert hidden.tools is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/X"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        plan_tool_choice(request(**body), auto_enabled=True)
    assert e.value.status == 400 and e.value.param == param


def test_required_with_another_constraint_is_refused():
    plan = plan_tool_choice(request(tools=[WEATHER], tool_choice="required"), True)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(APIError, match="cannot be combined") as e:
        apply_tool_grammar(plan, params)
    assert e.value.param == "tool_choice"


def test_conflicting_defs_are_refused():
    other = json.loads(json.dumps(WEATHER))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["Unit"] = {"enum": ["k"]}
    with pytest.raises(APIError, match="Unit") as e:
        plan_tool_choice(request(tools=[WEATHER, other], tool_choice="required"), True)
    assert e.value.param == "tools.1.function.parameters"


def test_required_grammar(tok):
    """At least one call (one when parallel_tool_calls is false) of a tool named in `tools`, with that tool's
    arguments; the tools' $defs resolve from the root."""
    plan = plan_tool_choice(request(tools=[WEATHER, TIME], tool_choice="required"), auto_enabled=False)
    spec = plan.structured_outputs
    one = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}}]'
    two = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo","unit":"f"}}]'
    assert accepts(tok, spec, one) and accepts(tok, spec, two)
    assert not accepts(tok, spec, "[]")
    assert not accepts(tok, spec, '[{"name":"get_weather","parameters":{"city":"Paris","unit":"x"}}]')
    assert not accepts(tok, spec, '[{"name":"unknown","parameters":{}}]')
    single = plan_tool_choice(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), False)
    assert accepts(tok, single.structured_outputs, one) and not accepts(tok, single.structured_outputs, two)


def test_named_grammar(tok):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tool_choice(request(tools=[WEATHER, TIME], tool_choice=choice), auto_enabled=False)
    assert (plan.mode, plan.function) == ("named", "get_weather")
    assert accepts(tok, plan.structured_outputs, '{"city":"Paris","unit":"f"}')
    assert not accepts(tok, plan.structured_outputs, '{"city":"Paris"}')
    empty = plan_tool_choice(
        request(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), False
    )
    assert accepts(tok, empty.structured_outputs, "{}") and not accepts(tok, empty.structured_outputs, "[]")


# ---------------------------------------------------------------------------------------------------- messages
def test_messages_for_the_template():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}],
                },
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "use the tool",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"},
            ],
            "tools": [WEATHER],
        }
    )
    msgs = chat_messages(req.messages)
    assert msgs[0] == {"role": "system", "content": "Be brief.\nReally."}
    assert msgs[2]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert msgs[2]["tool_calls"][1]["function"]["arguments"] == {} and msgs[2]["reasoning_content"] == "use the tool"
    assert msgs[3] == {"role": "tool", "content": "18C", "name": "get_weather", "tool_call_id": "call_1"}
    (tool,) = template_tools(req.tools)
    assert tool["type"] == "function" and tool["function"]["name"] == "get_weather" and "strict" not in tool["function"]


@pytest.mark.parametrize(("arguments", "match"), [('{"city": ', "not valid JSON"), ("[1, 2]", "JSON object")])
def test_malformed_history_is_a_400_naming_the_message(arguments, match):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    req = ChatCompletionRequest.model_validate({"messages": msgs})
    with pytest.raises(APIError, match=match) as e:
        chat_messages(req.messages)
    assert e.value.param == "messages.1.tool_calls.0.function.arguments" and "messages[1]" in e.value.message


# ---------------------------------------------------------------------------------------------------- one choice
def read(output: ChatOutput, text: str, step: int):
    p = output.choice()
    deltas = [p.feed(text[i : i + step]) for i in range(0, len(text), step)] + [p.finish()]
    return p, [d for d in deltas if d is not None]


def test_reasoning_then_tool_calls_then_content(tok):
    config = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    req = request(tools=[WEATHER])
    out = ChatOutput.plan(config, req, config.plan_tools(req), tok, "<|im_start|>assistant\n")
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    text = f"<think>\nuse <tool_call> here\n</think>\n\nChecking.<tool_call>\n{call}\n</tool_call>"
    whole = out.choice()
    msg = whole.message(text)
    assert msg.reasoning_content == "\nuse <tool_call> here\n" and msg.content == "\n\nChecking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for step in (1, 2, 3, 7, 11):
        p, deltas = read(out, text, step)
        assert "".join(d.reasoning_content or "" for d in deltas) == msg.reasoning_content
        content, calls = assemble(deltas)
        assert content == msg.content
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]


def test_named_and_required_and_none(tok):
    config = ChatOutputConfig()
    named = request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = ChatOutput.plan(config, named, config.plan_tools(named), tok, "")
    p = out.choice()
    msg = p.message('{"city":"Paris","unit":"c"}')
    assert msg.content is None and msg.tool_calls[0].function.arguments == '{"city":"Paris","unit":"c"}'
    assert p.finish_reason("stop") == "stop"  # a forced function stays "stop" (OpenAI, vLLM)
    params = SamplingParams()
    out.adjust(params)
    assert params.structured_outputs == out.tools.structured_outputs and params.skip_special_tokens

    required = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    out = ChatOutput.plan(config, required, config.plan_tools(required), tok, "")
    p = out.choice()
    msg = p.message('[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{}}]')
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]  # parallel_tool_calls=false keeps the first
    assert p.finish_reason("stop") == "tool_calls"

    none = request(tools=[WEATHER], tool_choice="none")
    out = ChatOutput.plan(config, none, config.plan_tools(none), tok, "")
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert out.choice().message(text).content == text and out.choice().message("").content == ""


def test_special_token_tags_keep_special_tokens(tok):
    """A tokenizer whose `<tool_call>` is a special token loses it under skip_special_tokens: the plan keeps
    special tokens (vLLM's adjust_request); the engine leaves out the text of the token that ends a choice."""
    backend = tokenizers.Tokenizer.from_file(str(FIXTURES / "tiny-qwen3" / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    special = Tokenizer(backend, tok.special)
    config = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    req = request(tools=[WEATHER])
    plain = ChatOutput.plan(config, req, config.plan_tools(req), tok, "")
    assert not plain.keep_special_tokens
    out = ChatOutput.plan(config, req, config.plan_tools(req), special, "")
    assert out.keep_special_tokens
    params = SamplingParams()
    out.adjust(params)
    assert params.skip_special_tokens is False
    text = 'Hi<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert out.choice().message(text).content == "Hi"


def test_config_checks():
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ChatOutputConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ChatOutputConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ChatOutputConfig(reasoning_parser="nope")
    assert ChatOutputConfig(tool_call_parser="hermes").auto_tools is None  # a parser alone does not enable "auto"


def test_a_tool_message_must_answer_tool_calls():
    """As OpenAI: a tool result follows an assistant message with tool_calls (other results may come between)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]
    assert len(chat_messages(ChatCompletionRequest.model_validate({"messages": ok}).messages)) == 4
    for bad, i in (([{"role": "tool", "content": "x"}], 0), ([*ok, {"role": "user", "content": "y"}, ok[2]], 5)):
        with pytest.raises(APIError) as e:
            chat_messages(ChatCompletionRequest.model_validate({"messages": bad}).messages)
        assert e.value.param == f"messages.{i}.role"


def test_batch_jobs_read_tool_calls_as_the_server(tmp_path):
    """netra-jax batch with the server's flags: tool calls and thinking come out of the same pipeline (auto with
    the model's text forced by a regex, a named function and "required" under their grammars)."""
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig
    from netra_jax.serving.batch import run_batch

    clock = {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["utc"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    }
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>'
    base = {"messages": [{"role": "user", "content": "Time?"}], "tools": [clock], "max_tokens": 100, "temperature": 0}
    bodies = {
        "auto": {**base, "structured_outputs": {"regex": re.escape(text)}},
        "named": {**base, "tool_choice": {"type": "function", "function": {"name": "clock"}}},
        "required": {**base, "tool_choice": "required", "parallel_tool_calls": False},
    }
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b} for k, b in bodies.items()]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = build_engine(
        EngineConfig(model=str(FIXTURES / "tiny-qwen3"), warmup=False, cache=CacheConfig(num_pages=32))
    )
    config = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    run_batch(inp, out, engine, progress=False, chat_output=config)
    got = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, out.read_text().splitlines())}
    for key, finish in (("auto", "tool_calls"), ("named", "stop"), ("required", "tool_calls")):
        (call,) = got[key]["message"]["tool_calls"]
        assert call["function"]["name"] == "clock" and json.loads(call["function"]["arguments"]) == {"tz": "utc"}
        assert got[key]["finish_reason"] == finish, key
    assert got["auto"]["message"]["reasoning_content"] == "\nhm\n" and got["auto"]["message"]["content"] is None


def test_parallel_tool_calls_false_keeps_the_first_call_and_ids_follow_the_parser(tok):
    config = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
    req = request(tools=[WEATHER, TIME], parallel_tool_calls=False)
    out = ChatOutput.plan(config, req, config.plan_tools(req), tok, "")
    msg = out.choice().message('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    named = request(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = ChatOutput.plan(config, named, config.plan_tools(named), tok, "").choice().message("{}").tool_calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # a Mistral server's ids, for its template's history check
