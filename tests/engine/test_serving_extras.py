"""vLLM's request extras through the serving pipeline shared by the server and batch jobs (serving.chat,
serving.completion) on tiny-qwen3: chat_template_kwargs, reasoning_effort, continue_final_message, echo on chat,
request_id, truncate_prompt_tokens, structured_outputs and guided_*, each refusal a 400 naming its field."""

from __future__ import annotations

import re

import pytest
from support.checkpoints import FIXTURES

from netra_jax.engine.factory import build_engine
from netra_jax.engine_config import EngineConfig, SchedulerConfig
from netra_jax.serving.chat import chat_response, prepare_chat
from netra_jax.serving.chat_output import ChatOutputConfig
from netra_jax.serving.completion import completion_response, prepare_completion
from netra_jax.serving.context import ServingContext
from netra_jax.serving.errors import APIError
from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest

# the fixtures' ChatML template, plus two variables a request may set through chat_template_kwargs / reasoning_effort
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if flag is defined %}[flag={{ flag }}]{% endif %}"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = {"role": "user", "content": "the cat sat on the mat"}


@pytest.fixture(scope="module")
def ctx():
    cfg = EngineConfig(
        model=str(FIXTURES / "tiny-qwen3"),
        dtype="float32",
        warmup=False,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
    )
    return ServingContext.of(build_engine(cfg), "tiny-qwen3", TEMPLATE)


def run(ctx: ServingContext, prompts, params, rid: str):
    """Every prompt through the engine to the end; the RequestOutputs in prompt order."""
    llm = ctx.llm
    ids = [f"{rid}-{i}" for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        llm.add_request(ids[i], p, params.clone())
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    assert llm.pool.num_in_use == 0
    return [done[i] for i in ids]


def chat(ctx, **body):
    req = ChatCompletionRequest.model_validate({"messages": [USER], **body})
    plan = prepare_chat(ctx, req)
    return req, plan


def refused(fn, param: str) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


def test_template_kwargs_and_reasoning_effort_reach_the_template(ctx):
    _, plan = chat(ctx, chat_template_kwargs={"flag": "on"}, reasoning_effort="low")
    assert "[flag=on][effort=low]<|im_start|>assistant\n" in plan.prompt["prompt"]
    _, plain = chat(ctx)
    assert "[flag=" not in plain.prompt["prompt"] and "[effort=" not in plain.prompt["prompt"]
    for key in ("tools", "messages", "add_generation_prompt", "chat_template"):
        refused(lambda key=key: chat(ctx, chat_template_kwargs={key: 1}), f"chat_template_kwargs.{key}")


def test_continue_final_message_and_echo(ctx):
    partial = {"role": "assistant", "content": "The cat"}
    req, plan = chat(ctx, messages=[USER, partial], continue_final_message=True, echo=True, max_tokens=4, temperature=0)
    assert plan.prompt["prompt"].endswith("<|im_start|>assistant\nThe cat")  # left open, no <|im_end|>
    resp = chat_response(ctx, req, plan, run(ctx, [plan.prompt], plan.params, plan.engine_id))
    text = resp.choices[0].message.content
    assert text.startswith("The cat") and resp.usage.completion_tokens == 4
    # the same request without echo answers only the continuation
    req2, plan2 = chat(ctx, messages=[USER, partial], continue_final_message=True, max_tokens=4, temperature=0)
    resp2 = chat_response(ctx, req2, plan2, run(ctx, [plan2.prompt], plan2.params, plan2.engine_id))
    assert text == "The cat" + resp2.choices[0].message.content
    # echo only repeats an assistant message (the role of the answer)
    _, plan3 = chat(ctx, echo=True)
    assert plan3.echo is None
    refused(lambda: chat(ctx, continue_final_message=True), "continue_final_message")
    refused(
        lambda: chat(ctx, messages=[USER, partial], continue_final_message=True, add_generation_prompt=True),
        "add_generation_prompt",
    )


def test_request_id_names_the_response(ctx):
    _, plan = chat(ctx, request_id="my-trace-7")
    assert plan.id == "chatcmpl-my-trace-7" and plan.engine_id.startswith("chatcmpl-my-trace-7-")
    _, again = chat(ctx, request_id="my-trace-7")
    assert again.engine_id != plan.engine_id  # a reused request_id never collides inside the engine
    cplan = prepare_completion(ctx, CompletionRequest.model_validate({"prompt": "x", "request_id": "r1"}))
    assert cplan.id == "cmpl-r1"
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", prepare_completion(ctx, CompletionRequest(prompt="x")).id)


def test_truncate_prompt_tokens_keeps_the_tail(ctx):
    ids = list(range(5, 45))
    req = CompletionRequest.model_validate({"prompt": ids, "truncate_prompt_tokens": 7, "max_tokens": 2})
    plan = prepare_completion(ctx, req)
    assert plan.prompt_ids == [ids[-7:]] and plan.prompts == [ids[-7:]]
    text = ctx.llm.tokenizer.decode(ids)
    plan = prepare_completion(ctx, CompletionRequest(prompt=text, truncate_prompt_tokens=5, echo=True))
    full = ctx.llm.tokenizer.encode(text)
    assert plan.prompt_ids == [full[-5:]] and plan.echo == [ctx.llm.tokenizer.decode(full[-5:])]
    same = prepare_completion(ctx, CompletionRequest(prompt=text, truncate_prompt_tokens=-1))
    assert same.prompt_ids == [full]  # -1: the model's context, which the prompt fits
    _, cplan = chat(ctx, truncate_prompt_tokens=3)
    assert len(cplan.prompt_ids) == 3 and cplan.prompt == cplan.prompt_ids
    refused(
        lambda: prepare_completion(ctx, CompletionRequest(prompt="x", truncate_prompt_tokens=0)),
        "truncate_prompt_tokens",
    )
    big = ctx.llm.max_model_len + 1
    refused(
        lambda: prepare_completion(ctx, CompletionRequest(prompt="x", truncate_prompt_tokens=big)),
        "truncate_prompt_tokens",
    )
    # a prompt beyond the context is answered once truncated
    long = CompletionRequest(prompt=[7] * (ctx.llm.max_model_len + 10), truncate_prompt_tokens=100, max_tokens=2)
    assert len(prepare_completion(ctx, long).prompt_ids[0]) == 100


@pytest.mark.parametrize(
    "field",
    [
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
        {"guided_choice": ["alpha", "beta"]},
        {"structured_outputs": {"regex": "(alpha|beta)"}},
        {"guided_regex": "(alpha|beta)"},
    ],
)
def test_structured_outputs_and_guided_forms_constrain_the_output(ctx, field):
    req = CompletionRequest.model_validate({"prompt": "pick one:", "max_tokens": 8, "temperature": 1, **field})
    plan = prepare_completion(ctx, req)
    resp = completion_response(ctx, req, plan, run(ctx, plan.prompts, plan.params, plan.engine_id))
    assert resp.choices[0].text in ("alpha", "beta") and resp.choices[0].finish_reason == "stop"


def test_output_constraints_are_one_and_well_formed(ctx):
    base = {"prompt": "x"}
    two = {**base, "guided_regex": "a", "response_format": {"type": "json_object"}}
    e = refused(lambda: prepare_completion(ctx, CompletionRequest.model_validate(two)), "guided_regex")
    assert "response_format, guided_regex" in e.message
    empty = {**base, "structured_outputs": {}}
    refused(lambda: prepare_completion(ctx, CompletionRequest.model_validate(empty)), "structured_outputs")
    bad_json = {**base, "guided_json": "{not json"}
    e = refused(lambda: prepare_completion(ctx, CompletionRequest.model_validate(bad_json)), "guided_json")
    assert "guided_json" in e.message


def test_completions_default_to_16_tokens(ctx):
    req = CompletionRequest.model_validate({"prompt": "the", "temperature": 0, "ignore_eos": True})
    plan = prepare_completion(ctx, req)
    resp = completion_response(ctx, req, plan, run(ctx, plan.prompts, plan.params, plan.engine_id))
    assert plan.params.max_tokens == 16 and resp.usage.completion_tokens == 16


def test_a_constrained_answer_is_not_read_as_thinking(ctx):
    """deepseek_r1's template opens a thinking block, but a grammar (a forced tool call, a response format) writes
    the output from its first token: it is thinking only where it writes the start tag itself."""
    thinking = ServingContext.of(ctx.llm, "tiny-qwen3", TEMPLATE, ChatOutputConfig(reasoning_parser="deepseek_r1"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = {"type": "function", "function": {"name": "f"}}
    cases = [
        ({"tools": [tool], "tool_choice": forced}, '{"x": 1}', (None, None, [("f", '{"x": 1}')])),
        (
            {"tools": [tool], "tool_choice": "required"},
            '[{"name": "f", "parameters": {}}]',
            (None, None, [("f", "{}")]),
        ),
        ({"response_format": {"type": "json_object"}}, '{"x": 1}', (None, '{"x": 1}', [])),
        ({"guided_regex": "<think>a</think>b"}, "<think>a</think>b", ("a", "b", [])),  # a grammar that thinks
        ({}, "hm</think>ok", ("hm", "ok", [])),  # unconstrained: the output opens inside the thinking block
    ]
    for body, text, want in cases:
        _, plan = chat(thinking, **body)
        msg = plan.output.choice().message(text)
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
        assert (msg.reasoning_content, msg.content, calls) == want, body
