"""Pydantic schemas of OpenAI's Responses API (POST /v1/responses): the request with its input items, function tools,
tool choice and text format, the `response` object with its output items and usage, and the streamed events.

Requests are strict as in serving/protocol.py (an unknown field is a 400 naming it), except inside input items,
which ignore unknown keys so that a previous response's output items can be sent back as they are (`id`, `status`,
`annotations`, ...). Item, part and tool types this server cannot serve (images, files, built-in tools, item
references) pass validation and are refused while the request is converted, with a 400 naming the field."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_serializer

from netra_jax.serving.protocol import ChatLogprobEntry, FunctionDefinition, _opt, _Out, _Strict

# ---------------------------------------------------------------------------------------------------- requests
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value served


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Lenient):
    """A part of an input message: input_text (user turns), output_text or refusal (an earlier answer sent back).
    Other types (input_image, input_file, input_audio) are refused when the request is converted."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Lenient):
    """A message; `type` may be left out (OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    """A function call of an earlier answer, sent back in the history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object's text


class FunctionCallOutputItem(_Lenient):
    """The result of a function call, answering the call with the same call_id."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Lenient):
    """An earlier answer's reasoning; its text goes to the following assistant turn's reasoning_content."""

    type: Literal["reasoning"]
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None


class OtherItem(BaseModel):
    """An input item of a type this server does not serve (item_reference, web_search_call, ...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


def _item_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        kind = v.get("type", "message")
    elif isinstance(v, BaseModel):
        kind = getattr(v, "type", None)
    else:
        return None
    return f"item[{kind}]" if kind in INPUT_ITEMS else "item[other]"


# Tags are written "item[...]": an error's field path leaves out parts holding "[" (serving/errors.py), so a bad
# field reads `input.2.call_id`, not `input.2.function_call.call_id`.
InputItem = Annotated[
    Annotated[MessageItem, Tag("item[message]")]
    | Annotated[FunctionCallItem, Tag("item[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("item[function_call_output]")]
    | Annotated[ReasoningItem, Tag("item[reasoning]")]
    | Annotated[OtherItem, Tag("item[other]")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_input_item",
        custom_error_message="an input item must be an object (a message or an item with a type)",
    ),
]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape: {"type": "function", "name", "description",
    "parameters", "strict"} (chat completions nest the same fields under "function")."""

    type: Literal["function"]


class OtherTool(BaseModel):
    """A built-in tool (web_search, file_search, code_interpreter, mcp, ...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return None if kind is None else "tool[function]" if kind == "function" else "tool[other]"


Tool = Annotated[
    Annotated[FunctionTool, Tag("tool[function]")] | Annotated[OtherTool, Tag("tool[other]")],
    Discriminator(
        _tool_kind, custom_error_type="invalid_tool", custom_error_message="a tool must be an object with a type"
    ),
]


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class OtherToolChoice(BaseModel):
    """A tool choice naming a built-in tool, an MCP server or an allowed_tools list: refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


ResponsesToolChoice = Annotated[
    Literal["none", "auto", "required"] | ToolChoiceFunction | OtherToolChoice,
    Field(union_mode="left_to_right"),
]


class TextFormat(_Strict):
    """text.format: plain text, any JSON object, or JSON following `schema` (always enforced, strict or not)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; not applied here


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # passed to the chat template
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: the reasoning text is returned
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated name of summary


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is added; accepted for the SDK


class ResponsesRequest(_Strict):
    """POST /v1/responses. Stateless: `store` is accepted and nothing is kept (the response says store: false);
    previous_response_id, conversation, prompt templates and background mode need stored state and are refused."""

    model: str | None = None
    input: list[InputItem] | str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None  # with include ["message.output_text.logprobs"]
    include: list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ResponsesToolChoice | None = None  # None: "auto" when tools are given, else "none"
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None  # limits built-in tool calls, of which there are none here
    # informational OpenAI fields, accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # need stored state: refused with a 400 naming them
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------------- responses
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "failed", "in_progress", "incomplete", "cancelled"]


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogprobEntry] = Field(default_factory=list)  # with include message.output_text.logprobs


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Out):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(_Out):
    cached_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Out):
    code: str  # OpenAI's codes: server_error, rate_limit_exceeded, invalid_prompt
    message: str


class ResponseObject(_Out):
    """OpenAI's `response` object. `store` is always false: this server keeps no response."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    top_logprobs: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction
    text: TextConfig
    parallel_tool_calls: bool
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    completed_at: int | None = None

    @field_serializer("text")
    def _text(self, t: TextConfig) -> dict[str, Any]:  # OpenAI's shape: {"format": {"type": "text"}}
        return t.model_dump(mode="json", by_alias=True, exclude_none=True)


# ---------------------------------------------------------------------------------------------------- events
class _Event(_Out):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class OutputItemEvent(_Event):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    """response.output_text.delta / response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatLogprobEntry] | None = _opt()  # output_text: a list (empty unless included); reasoning: none


class TextDoneEvent(_Event):
    """response.output_text.done / response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatLogprobEntry] | None = _opt()  # output_text: a list (empty unless included); reasoning: none


class ArgumentsDeltaEvent(_Event):
    """response.function_call_arguments.delta."""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    """response.function_call_arguments.done."""

    item_id: str
    output_index: int
    name: str
    arguments: str
