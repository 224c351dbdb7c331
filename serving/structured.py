"""Structured output on the API: an OpenAI `response_format` (json_object / json_schema) becomes the engine's
StructuredOutputsParams, which the engine compiles with llguidance (netra_jax.structured_output) and enforces."""

from __future__ import annotations

from netra_jax.sampling_params import StructuredOutputsParams
from netra_jax.serving.protocol import ResponseFormat
from netra_jax.structured_output import StructuredOutputError


def structured_outputs_for(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    """The spec of a response_format; None for plain text. `json_schema.strict` changes nothing: the schema is
    always enforced. Raises StructuredOutputError when a json_schema format has no schema."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise StructuredOutputError("response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)
