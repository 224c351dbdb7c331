"""Structured output through the engine on tiny-qwen3 (random weights, so only the constraint can make the output
valid): JSON schemas greedy and sampled, json_object, regex and choice, grammar end -> "stop", batch invariance of
unconstrained neighbours, greedy equal to an independent masked argmax over full-forward logits, bad specs refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.schemas import SCHEMA, check_schema

from netra_jax import SamplingParams
from netra_jax.sampling_params import StructuredOutputsParams as SO
from netra_jax.structured_output import StructuredOutputError, StructuredOutputs, closed_objects


@pytest.fixture(scope="module")
def llm():
    from netra_jax import LLM

    return LLM(str(FIXTURES / "tiny-qwen3"), warmup=False, num_kv_pages=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts():
    return [c["prompt_ids"] for c in reference("tiny-qwen3")["cases"]]


def gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs for o in outs]


def test_schema_greedy_and_sampled_outputs_validate(llm, prompts):
    so = SO(json=SCHEMA)
    greedy = SamplingParams(max_tokens=128, temperature=0, structured_outputs=so)
    sampled = [SamplingParams(max_tokens=128, temperature=1.0, seed=s, structured_outputs=so) for s in range(4)]
    sampled.append(
        SamplingParams(n=2, max_tokens=128, temperature=1.0, seed=9, structured_outputs=SO(json=json.dumps(SCHEMA)))
    )
    outs = gen(llm, [prompts[0], *[prompts[1]] * 5], [greedy, *sampled])
    texts = []
    for samples in outs:
        for o in samples:
            assert o.finish_reason == "stop" and o.stop_reason is None, o
            check_schema(json.loads(o.text))
            texts.append(o.text)
    assert len(set(texts[1:])) >= 3  # different seeds, different valid objects
    plain = gen(llm, [prompts[0]], SamplingParams(max_tokens=40, temperature=0))[0][0].text
    with pytest.raises(ValueError):
        json.loads(plain)  # the constraint, not the model, makes it JSON


def test_greedy_equals_masked_argmax_of_full_forward_logits(llm, prompts):
    """Reference: one full forward per token through LLM.logits, argmax over the grammar's allowed tokens."""
    so = SO(json=SCHEMA)
    got = gen(llm, [prompts[2]], SamplingParams(max_tokens=128, temperature=0, structured_outputs=so))[0][0]
    m = StructuredOutputs(llm.get_tokenizer(), llm.model_config.vocab_size).matcher(so)
    ids: list[int] = []
    while not m.done:
        logits = llm.logits(prompts[2] + ids)[-1]
        tok = int(np.argmax(np.where(m.allowed(), logits, -np.inf)))
        assert m.accept(tok)
        ids.append(tok)
    assert list(got.token_ids) == ids


def test_json_object_regex_and_choice(llm, prompts):
    obj = SO(json_object=True)
    choices = ['say "yes"', "nö", "x\\y"]
    params = [SamplingParams(max_tokens=64, temperature=0, structured_outputs=obj)] * 3
    params += [SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs=obj) for s in range(3)]
    params.append(
        SamplingParams(max_tokens=16, temperature=1.0, seed=2, structured_outputs=SO(regex=r"[0-9]{3}-[a-c]{2}"))
    )
    params.append(SamplingParams(max_tokens=16, temperature=0, structured_outputs=SO(choice=choices)))
    outs = [o[0] for o in gen(llm, [*prompts, *prompts, *prompts[:2]], params)]
    objects = [o for o in outs[:6] if o.finish_reason == "stop"]  # a free-form object may outgrow max_tokens
    assert len(objects) >= 3 and all(isinstance(json.loads(o.text), dict) for o in objects)
    assert all(o.text.startswith("{") for o in outs[:6])
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", outs[6].text) and outs[6].finish_reason == "stop"
    assert outs[7].text in choices and outs[7].finish_reason == "stop"


def test_unconstrained_neighbours_are_batch_invariant(llm, prompts):
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [o[0].token_ids for o in gen(llm, prompts[:3], plain)]
    so = SamplingParams(max_tokens=60, temperature=0, structured_outputs=SO(json=SCHEMA))
    mixed = gen(llm, [prompts[0], prompts[2], prompts[1], prompts[0], prompts[2]], [plain, so, plain, so, plain])
    assert [mixed[i][0].token_ids for i in (0, 2, 4)] == alone
    check_schema(json.loads(mixed[1][0].text))


def test_bad_specs_are_refused_before_queueing(llm):
    eng = llm.engine
    bad = [
        SO(json={"type": "nonsense"}),
        SO(regex="((("),
        SO(grammar="start: ((("),
        SO(json={"type": "object", "x": object()}),
    ]
    for spec in bad:
        with pytest.raises(StructuredOutputError, match="invalid structured output spec"):
            eng.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
        assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    for spec in (SO(), SO(json=SCHEMA, regex="a"), SO(json="{not json"), SO(choice=[]), SO(json=[1])):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=spec).validate(512)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"json_object": True}).validate(512).structured_outputs.json_object


def test_model_vocab_beyond_the_tokenizer_is_never_allowed(llm):
    """A model vocabulary padded past the tokenizer's (600 > 512 ids): the padding ids stay masked at every step."""
    m = StructuredOutputs(llm.get_tokenizer(), 600).matcher(SO(json=SCHEMA))
    text = json.dumps({"name": "ab", "age": 7, "pet": "dog", "tags": [True]}, separators=(",", ":"))
    for tok in llm.get_tokenizer().encode(text, add_special_tokens=False):
        allowed = m.allowed()
        assert allowed.shape == (600,) and allowed[tok] and not allowed[512:].any()
        assert m.accept(tok)
    assert m.done and m.mask().size == 19


# the grammar of vLLM's structured-output examples, in GBNF (`root ::= ...`) rather than Lark
SQL_GBNF = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


def test_gbnf_grammar_as_in_vllms_examples(llm, prompts):
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs=SO(grammar=SQL_GBNF))
        for s in range(3)
    ]
    outs = [o[0] for o in gen(llm, prompts[:3], params)]
    sql = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "
    assert all(re.fullmatch(sql, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_objects_listing_their_properties_take_no_others(llm, prompts):
    """A schema that leaves additionalProperties out gets no made-up keys (vLLM's default backend reads it so);
    an explicit additionalProperties, an allOf's parts and a property named like a keyword are left as they are."""
    open_schema = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
    open_schema["properties"] = {
        **SCHEMA["properties"],
        "home": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=s, structured_outputs=SO(json=open_schema))
        for s in range(6)
    ]
    objects = [
        json.loads(o[0].text)
        for o in gen(llm, [prompts[s % 3] for s in range(6)], params)
        if o[0].finish_reason == "stop"
    ]
    assert len(objects) >= 3
    for obj in objects:
        assert set(obj) <= set(open_schema["properties"]), obj
        assert set(obj.get("home", {})) <= {"x"}, obj
    kept = {
        "type": "object",
        "properties": {"properties": {"type": "object"}},
        "additionalProperties": {"type": "integer"},
    }
    assert closed_objects(kept) == kept
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(both) == both
    nested = {"$defs": {"P": {"properties": {"properties": {"type": "string"}}}}, "items": [{"properties": {}}]}
    assert closed_objects(nested) == {
        "$defs": {"P": {"properties": {"properties": {"type": "string"}}, "additionalProperties": False}},
        "items": [{"properties": {}, "additionalProperties": False}],
    }


def test_token_outside_the_grammar_ends_the_sample_with_error(llm, prompts):
    """Should a token the grammar rejects ever be sampled (here: a mask that allows everything), the sample ends
    with finish_reason "error" and frees its KV blocks instead of continuing unconstrained."""
    eng = llm.engine
    eng.add_request("broken", prompts[0], SamplingParams(max_tokens=8, temperature=0, structured_outputs=SO(regex="q")))
    eng._sample_of["broken"][1].grammar.mask = lambda: np.full(16, -1, np.int32)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].outputs[0].finish_reason == "error" and len(outs[-1].outputs[0].token_ids) == 1
    assert eng.pool.num_in_use == 0
