"""Tool-call parsers by name (vLLM's --tool-call-parser names): each turns a model's written tool calls into
OpenAI tool calls, for a whole answer and for streamed deltas."""

from __future__ import annotations

from netra_jax.serving.tool_parsers.base import ToolParser, assemble, make_tool_call_id
from netra_jax.serving.tool_parsers.hermes import HermesToolParser
from netra_jax.serving.tool_parsers.llama3_json import Llama3JsonToolParser
from netra_jax.serving.tool_parsers.mistral import JsonCallList, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "JsonCallList",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolParser",
    "assemble",
    "get_tool_parser",
    "make_tool_call_id",
]
