"""`netra-jax serve` with no model (the embedded SmolLM2-135M-Instruct) answers the SmolLM2 reference chats with
exactly transformers' greedy text at temperature 0, through the openai client, streamed and not (with float
activations, `--matmul-backend cpu_rows`: the default rounds them to int8 as llama.cpp does)."""

from __future__ import annotations

import httpx
import pytest
from support.checkpoints import reference
from support.server import openai_client, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_path):  # smollm2_path fetches the default model once
    flags = ("--no-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--matmul-backend", "cpu_rows")
    with running_server(*flags, model=None) as s:
        yield s


def test_default_model_answers_reference_chat(server):
    client = openai_client(server, timeout=300)
    (card,) = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct"
    case = reference("smollm2")["cases"][0]
    tok = httpx.post(server.url + "/tokenize", json={"messages": case["messages"]}).json()
    assert tok["tokens"] == case["prompt_ids"]
    r = client.chat.completions.create(model=card.id, messages=case["messages"], temperature=0, max_tokens=48)
    assert r.choices[0].message.content == case["greedy_text"]
    assert r.choices[0].finish_reason == case["finish"]
    assert r.usage.prompt_tokens == len(case["prompt_ids"]) and r.usage.completion_tokens == len(case["greedy_ids"])
    stream = client.chat.completions.create(
        model=card.id, messages=case["messages"], temperature=0, max_tokens=48, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == case["greedy_text"]
