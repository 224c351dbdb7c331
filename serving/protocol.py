"""Pydantic schemas of the OpenAI-compatible API (completions, chat completions, stream chunks, usage, logprobs,
models, tokenize, error envelope) plus vLLM's sampling extras, and their conversion to SamplingParams.

Unknown-field policy: request bodies are validated strictly, as OpenAI's own API does. A field this server does not
know is rejected with 400 naming it (a typo such as `max_token` never passes silently), and so is a value of the
wrong JSON type (`"max_tokens": "10"`). Informational OpenAI fields (`user`, `metadata`, `store`, `service_tier`,
`safety_identifier`, `prompt_cache_key`) are accepted and ignored. Chat messages alone ignore unknown keys, so a
previous response's message can be sent back as it is (`refusal`, `annotations`, ...)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from netra_jax.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


def _opt(default=None):
    """An optional extra, left out of the JSON when unset."""
    return Field(default=default, exclude_if=lambda v: v is None)


# ---------------------------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extra: usage in every chunk


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsSpec(_Strict):
    """vLLM's `structured_outputs` object: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional here: the one served model is meant
    max_tokens: int | None = None  # None = the rest of the context
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    response_format: ResponseFormat | None = None
    # informational OpenAI fields, accepted and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`
    prompt_cache_key: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM extra: token ids of the prompt and of each choice
    prompt_logprobs: int | None = None  # vLLM extra: logprobs of every prompt token (and this many alternatives)
    structured_outputs: StructuredOutputsSpec | None = None  # vLLM extra; so are the four guided_* forms below
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = 0  # vLLM extra: lower runs first under --scheduling-policy priority
    request_id: str | None = None  # vLLM extra: the response id is built from it
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM extra: keep the last k prompt tokens

    def _limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request (OpenAI defaults where a field is absent). Not yet validated."""
        sp = SamplingParams(
            n=self.n,
            max_tokens=self._limit(),
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage or self.continuous_usage))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions; None: the rest of the context
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON object's text (OpenAI), or the object itself


class ToolCallParam(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the history."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers
    reasoning_content: str | None = None  # an assistant turn's thinking, for templates that render it


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" when tools are given, else "none" (OpenAI's default)
    parallel_tool_calls: bool | None = None  # False: at most one tool call per answer
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_generation_prompt: bool = True  # vLLM extras from here on
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    echo: bool = False  # the last message's content is put before each choice's text

    def _limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or messages rendered as the chat route renders them (its template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


# ---------------------------------------------------------------------------------------------------- responses
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class UsageInfo(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Out):
    """vLLM's prompt_logprobs entry: one per prompt position (None for the first), keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token id that ended it
    token_ids: list[int] | None = _opt()  # vLLM extras (return_token_ids)
    prompt_token_ids: list[int] | None = _opt()
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _opt()  # vLLM extra (prompt_logprobs)


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(_Out):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    """A piece of a streamed tool call: the first has id, type and name; later ones append to arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = _opt()  # vLLM extra: the thinking, when a reasoning parser is on


class ChatChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _opt()


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _opt()
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _opt()  # vLLM extra (prompt_logprobs)


class DeltaMessage(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _opt()

    @field_serializer("delta")
    def _delta(self, d: DeltaMessage) -> dict[str, Any]:  # OpenAI omits absent delta fields: {} in the last chunk
        return d.model_dump(exclude_none=True)


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "netra_jax"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    prompt: str


class TokenizerInfoResponse(_Out):
    """vLLM's GET /tokenizer_info: the tokenizer's configuration (special tokens, added tokens by id, context
    length) and the chat template the server applies, left out when it has none."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    model_max_length: int
    added_tokens_decoder: dict[str, str] = Field(default_factory=dict)
    chat_template: str | None = _opt()


class ProbeStatus(_Out):
    """/health's and /ready's answer while they pass."""

    status: Literal["ok", "ready"]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorInfo
