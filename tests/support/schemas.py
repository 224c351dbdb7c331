"""The JSON schema the structured-output tests constrain answers to, and its checker: shared by the engine, server
and Responses API tests."""

from __future__ import annotations

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def check_schema(obj) -> None:
    """SCHEMA by hand, and by jsonschema when it is installed."""
    assert isinstance(obj, dict) and {"name", "age", "pet"} <= set(obj) <= {"name", "age", "pet", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 99 and obj["pet"] in ("cat", "dog")
    assert all(type(t) is bool for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(obj, SCHEMA)
