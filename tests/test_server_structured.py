"""Structured-output pieces (llguidance over the model's own tokenizer): a JSON schema's grammar masks every step,
and greedy decoding under it on tiny-qwen3 (random weights) still yields JSON that the schema accepts."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES, reference

pytest.importorskip("llguidance")

from netra_jax.serving.protocol import ResponseFormat  # noqa: E402
from netra_jax.serving.structured import (  # noqa: E402
    StructuredOutputError,
    StructuredOutputs,
    constrained_greedy,
    grammar_for,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    from netra_jax import LLM

    return LLM(str(FIXTURES / "tiny-qwen3"), warmup=False, num_kv_pages=16, max_num_seqs=2)


def test_json_schema_constrained_greedy(llm):
    so = StructuredOutputs(llm.get_tokenizer(), llm.model_config.vocab_size)
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    grammar = grammar_for(fmt)
    so.check(grammar)
    c = so.constraint(grammar)
    first = c.allowed()
    assert first.shape == (512,) and first.sum() >= 1
    assert all(llm.get_tokenizer().decode([t]).lstrip().startswith("{") for t in first.nonzero()[0])
    prompt = reference("tiny-qwen3")["cases"][0]["prompt_ids"]
    ids = constrained_greedy(llm, prompt, c, max_tokens=64)
    obj = json.loads(llm.get_tokenizer().decode(ids))
    assert set(obj) == {"name", "age", "pet"} and obj["pet"] in ("cat", "dog")
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6 and 0 <= obj["age"] <= 99
    assert c.done


def test_json_object_and_bad_schema(llm):
    so = StructuredOutputs(llm.get_tokenizer(), llm.model_config.vocab_size)
    c = so.constraint(grammar_for(ResponseFormat(type="json_object")))
    ids = constrained_greedy(llm, [1, 2, 3], c, max_tokens=24)
    assert llm.get_tokenizer().decode(ids).startswith("{")
    assert grammar_for(ResponseFormat(type="text")) is None
    bad = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    with pytest.raises(StructuredOutputError):
        so.check(grammar_for(bad))
