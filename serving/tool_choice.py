"""tool_choice as vLLM applies it: which tools the chat template shows, which parser reads the answer, and for
"required" or a named function the structured-output grammar that makes the model write valid calls (arguments
valid for the tool's schema whatever the model), plus the readers turning that constrained text into tool calls."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from netra_jax.sampling_params import SamplingParams, StructuredOutputsParams
from netra_jax.serving.errors import bad
from netra_jax.serving.protocol import ChatCompletionRequest, ChatCompletionTool, NamedToolChoice
from netra_jax.serving.tool_parsers import JsonCallList, ToolParser
from netra_jax.serving.tool_parsers.json_call import JsonCall
from netra_jax.structured_output import grammar_error

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoicePlan:
    """`mode`: none (answer is content), auto (the server's parser reads it), required / named (a grammar
    writes calls). `tools`: the template's `tools` (None: not shown)."""

    mode: Literal["none", "auto", "required", "named"]
    tools: list[ChatCompletionTool] | None = None
    function: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    """A tool's arguments schema (a copy): an absent or empty one is the empty object, as vLLM makes it."""
    params = copy.deepcopy(tool.function.parameters) if tool.function.parameters else dict(_EMPTY_OBJECT)
    if not any(k in params for k in ("type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        params["type"] = "object"
    return params


def required_schema(tools: list[ChatCompletionTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of `{"name": <a tool's name>, "parameters": <its arguments>}` (vLLM's
    form, closed to other keys), at least one (exactly one when parallel_tool_calls is false). The tools' `$defs`
    move to the root, where their `#/$defs/...` references point; one name defined two ways is a 400."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad(
                    f"tools[{i}]: the schema name {name!r} in $defs is defined differently by another tool; "
                    "tool_choice 'required' needs one definition per name",
                    f"tools.{i}.function.parameters",
                )
            defs[name] = schema
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # a call is its name and arguments: nothing to run on with
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """The spec, once its grammar compiles (so a bad tool schema is a 400 naming the tools, before admission)."""
    try:
        error = grammar_error(spec.validate())
    except ValueError as e:
        error = str(e)
    if error:
        raise bad(f"the tool's parameters schema cannot be enforced: {error}", param)
    return spec


def plan_tool_choice(
    req: ChatCompletionRequest, auto_enabled: bool, exclude_tools_when_none: bool = False
) -> ToolChoicePlan:
    """Validate `tools` / `tool_choice` (400 naming the field) and decide how the answer is produced and read.
    Absent tool_choice is "auto" with tools and "none" without (OpenAI's default, and vLLM's: "auto" without
    --enable-auto-tool-choice is a 400)."""
    tools, choice = req.tools, req.tool_choice
    if tools is not None and not tools:
        raise bad("tools must not be an empty array; leave it out to offer no tools", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoicePlan("none", None if exclude_tools_when_none else tools)
    if not tools:
        raise bad("when using tool_choice, tools must be set", "tool_choice")
    if choice == "auto":
        if not auto_enabled:
            raise bad(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolChoicePlan("auto", tools)
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise bad(
                f"tool_choice names the function {name!r}, which is not one of the tools "
                f"({', '.join(t.function.name for t in tools)})",
                "tool_choice.function.name",
            )
        spec = StructuredOutputsParams(json=_parameters(tool))
        i = tools.index(tool)
        return ToolChoicePlan("named", tools, name, _checked(spec, f"tools.{i}.function.parameters"))
    spec = StructuredOutputsParams(json=required_schema(tools, parallel))
    return ToolChoicePlan("required", tools, None, _checked(spec, "tools"))


def apply_tool_grammar(plan: ToolChoicePlan, params: SamplingParams) -> None:
    """Give the engine the grammar of "required" / a named function; a request that brings its own output
    constraint as well is a 400 (one grammar per request)."""
    if plan.structured_outputs is None:
        return
    if params.structured_outputs is not None:
        raise bad(
            "tool_choice 'required' or a named function writes its calls under a grammar, so it cannot be combined "
            "with response_format, structured_outputs or guided_*",
            "tool_choice",
        )
    params.structured_outputs = plan.structured_outputs


class GrammarToolOutput(ToolParser):
    """Calls written under a tool_choice grammar, read by `_reader()`; text after them (none under the grammar)
    is content."""

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        super().__init__(make_id)
        self._calls_reader = self._reader()

    def _reader(self) -> JsonCall | JsonCallList:
        raise NotImplementedError

    def _run(self, final: bool) -> None:
        r = self._calls_reader
        if not (r.done or r.invalid):
            self._buf = self._buf[r.feed(self._buf) :]
        if r.done or r.invalid:
            self.emit_content(self._buf)
            self._buf = ""
        elif final:
            r.close()


class NamedToolOutput(GrammarToolOutput):
    """The output of a named tool choice: the arguments object itself, the one call of that function."""

    def __init__(self, function: str, make_id: Callable[[], str] | None = None) -> None:
        self.function = function
        super().__init__(make_id)

    def _reader(self) -> JsonCall:
        return JsonCall(self, name=self.function)


class RequiredToolOutput(GrammarToolOutput):
    """The output of tool_choice "required": a JSON array of `{"name", "parameters"}` calls."""

    def _reader(self) -> JsonCallList:
        return JsonCallList(self, ("parameters",))
