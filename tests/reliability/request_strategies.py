"""Hypothesis strategies for request bodies drawn from the protocol models' JSON schemas, with edge values mixed
in (huge and negative integers, odd strings, out-of-vocabulary ids, made-up fields): the bad-input suite's generator."""

from __future__ import annotations

from hypothesis import strategies as st

from netra_jax.serving.protocol import CompletionRequest

VOCAB = 512  # the fixture models' vocabulary


def json_values(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """A strategy for JSON values of a pydantic JSON schema, with edge values mixed in (huge and negative ints,
    huge floats, odd strings)."""
    if "$ref" in schema:
        return json_values(defs[schema["$ref"].split("/")[-1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([json_values(s, defs, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "integer":
        return st.one_of(st.integers(-3, 8), st.integers(), st.sampled_from([VOCAB, 2**31, 2**63, -(2**63)]))
    if t == "number":
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.integers(-3, 3))
    if t == "string":
        return st.one_of(st.text(max_size=12), st.sampled_from(["", "\x00", "é中😀", "{{ 7 * 7 }}", "a" * 300]))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        item = json_values(schema.get("items", {"type": "integer"}), defs, depth + 1)
        return st.lists(item, min_size=schema.get("minItems", 0), max_size=4 if depth else 6)
    if t == "object":
        props = schema.get("properties")
        if props:
            return st.fixed_dictionaries({}, optional={k: json_values(v, defs, depth + 1) for k, v in props.items()})
        values = schema.get("additionalProperties")
        vs = json_values(values, defs, depth + 1) if isinstance(values, dict) else st.integers(-5, 5)
        keys = st.one_of(st.integers(-2, VOCAB + 2).map(str), st.text(max_size=4))
        return st.dictionaries(keys, vs, max_size=3)
    return st.one_of(st.none(), st.integers(), st.text(max_size=5))


def request_bodies(model: type) -> st.SearchStrategy:
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    props = {k: v for k, v in schema["properties"].items() if k != "response_format"}  # own suite: structured output
    small = st.one_of(st.integers(-1, 4), st.sampled_from([0, 10**30, 2**63]))
    bounded = {"max_tokens": small, "max_completion_tokens": small, "n": st.integers(-1, 3) | st.just(10**9)}
    opt = {k: bounded[k] if k in bounded else json_values(v, defs) for k, v in props.items()}
    required = {"max_tokens": st.integers(-1, 4)}  # never "the rest of the context": keeps valid requests short
    if model is CompletionRequest:
        tokens = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3)), max_size=6)
        required["prompt"] = st.one_of(
            st.text(max_size=20), tokens, st.lists(tokens, max_size=3), st.lists(st.text(max_size=8), max_size=3)
        )
    else:
        call = st.fixed_dictionaries(
            {"id": st.text(max_size=4), "type": st.just("function")},
            optional={
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=6)},
                    optional={"arguments": st.sampled_from(["{}", '{"a": 1}', "[1]", "{x", ""]) | st.text(max_size=6)},
                )
            },
        )
        msg = st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]),
                "content": st.one_of(st.text(max_size=20), st.none()),
            },
            optional={"tool_calls": st.lists(call, max_size=2), "tool_call_id": st.text(max_size=6)},
        )
        required["messages"] = st.lists(msg, max_size=3)
    opt = {k: v for k, v in opt.items() if k not in required}
    extra = st.fixed_dictionaries({}, optional={"unknown_field": st.integers(), "chat_template": st.just("{{ 1 }}")})
    many = st.tuples(st.fixed_dictionaries(required, optional=opt), extra).map(lambda t: {**t[0], **t[1]})
    # a few fields at a time: more of these requests are valid, so generation runs too
    few = st.lists(st.sampled_from(sorted(opt)), max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(required, optional={k: opt[k] for k in keys})
    )
    return st.one_of(many, few)
