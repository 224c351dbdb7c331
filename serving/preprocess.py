"""Turning validated API requests into engine inputs: prompts (text, token ids, batches, chat messages through the
chat template; vLLM's truncate_prompt_tokens) as token ids, and SamplingParams (with the one structured-output
constraint a request may give) checked against the model. Each failure is an APIError(400) naming the field."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.request import ContextLengthError, check_context_length
from netra_jax.engine.request_queue import check_priority
from netra_jax.lora_request import LoRARequest
from netra_jax.ops.sampling_batch import MAX_LOGPROBS
from netra_jax.sampling_params import SamplingParams, StructuredOutputsParams
from netra_jax.serving.context import ServingContext
from netra_jax.serving.errors import APIError, bad
from netra_jax.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from netra_jax.serving.structured import StructuredOutputError, structured_outputs_for
from netra_jax.structured_output import grammar_error
from netra_jax.tokenization.chat_template import NoChatTemplateError

if TYPE_CHECKING:
    from netra_jax.serving.protocol_embeddings import EmbeddingRequest

MAX_PROMPTS = 256  # prompts in one /v1/completions request
NO_CHAT_TEMPLATE = NoChatTemplateError.message(
    "start the server with --chat-template (a file or the Jinja source) to give it one, or send plain prompts to "
    "/v1/completions"
)
_FIELDS = set(SamplingParams.__dataclass_fields__)
# chat_template_kwargs may not set what the request's own fields (or the server) decide, nor the renderer's own
# arguments (chat_template.render_chat_template: template, special_tokens, limits)
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "template",
    "special_tokens",
    "limits",
)


def check_ids(engine: LLMEngine, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad(f"{param} is empty", param)
    bad_ids = [i for i in ids if not 0 <= i < engine.vocab_size]
    if bad_ids:
        raise bad(f"{param}: token id {bad_ids[0]} is outside the vocabulary [0, {engine.vocab_size})", param)
    return ids


def check_model(ctx: ServingContext, model: str | None) -> LoRARequest | None:
    """The LoRA adapter `model` names (None: the base model, also when absent); 404 for any other name."""
    if model is None or model == ctx.model_name:
        return None
    lora = ctx.adapters.get(model)
    if lora is not None:
        return lora
    names = [ctx.model_name, *(a.lora_name for a in ctx.adapters.all())]
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {', '.join(repr(n) for n in names)}",
        param="model",
        code="model_not_found",
    )


def response_id(prefix: str, req: SamplingRequest | EmbeddingRequest) -> str:
    """The response's id: `<prefix>-<request_id>` when the request names one (vLLM's extra), else (an empty one too,
    as vLLM) a random one."""
    return f"{prefix}-{req.request_id or uuid.uuid4().hex}"


def engine_id(response_id: str, req: SamplingRequest) -> str:
    """The engine request's id: the response id, made unique when the client named it (a request_id may be reused
    by concurrent requests)."""
    return f"{response_id}-{uuid.uuid4().hex[:12]}" if req.request_id else response_id


def truncate(engine: LLMEngine, ids: list[int], k: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `k` tokens (-1: the model's context length)."""
    if k is None:
        return ids
    if k == -1:
        k = engine.max_model_len
    if k == 0:
        raise bad("truncate_prompt_tokens must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    if k > engine.max_model_len:
        raise bad(
            f"truncate_prompt_tokens ({k}) is larger than the model's context of {engine.max_model_len} tokens",
            "truncate_prompt_tokens",
        )
    return ids[-k:]


def prompt_items(value: str | list[Any], param: str, limit: int, noun: str) -> list[Any]:
    """One item per prompt of a field in OpenAI's four forms (a string, a list of strings, token ids, a list of
    token-id lists); an empty field, or more than `limit` prompts (`noun`: what they are called), is a 400."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif not value:
        raise bad(f"{param} must not be empty", param)
    elif isinstance(value[0], int):
        items = [value]
    else:
        items = list(value)
    if len(items) > limit:
        raise bad(f"at most {limit} {noun} per request, got {len(items)}", param)
    return items


def completion_prompts(engine: LLMEngine, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt: a string, a list of strings, token ids, or a list of token-id lists.
    With truncate_prompt_tokens the ids keep their tail and the text is dropped (it no longer matches them)."""
    out = []
    for item in prompt_items(req.prompt, "prompt", MAX_PROMPTS, "prompts"):
        if isinstance(item, str):
            if not item:
                raise bad("prompt must not be an empty string", "prompt")
            text, ids = item, check_ids(engine, engine.tokenizer.encode(item), "prompt")
        else:
            text, ids = None, check_ids(engine, list(item), "prompt")
        kept = truncate(engine, ids, req.truncate_prompt_tokens)
        out.append((text if len(kept) == len(ids) else None, kept))
    return out


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """Extra chat-template variables: vLLM's chat_template_kwargs (e.g. enable_thinking) and reasoning_effort."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad(
                f"chat_template_kwargs may not set {key!r}: it is decided by the request's own fields or the server",
                f"chat_template_kwargs.{key}",
            )
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def chat_prompt(
    engine: LLMEngine,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> tuple[str, list[int]]:
    """The chat template applied to template-ready messages (a template may run up to its time limit: the server
    calls this in a thread). Returns the prompt text and its ids."""
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except NoChatTemplateError:
        raise bad(NO_CHAT_TEMPLATE, "messages", code="no_chat_template") from None
    except (ValueError, TypeError) as e:
        raise bad(f"chat template failed: {e}", "messages") from None
    return text, check_ids(engine, tok.encode(text, add_special_tokens=False), "messages")


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The one output constraint of a request: response_format (json_object / json_schema), vLLM's
    structured_outputs, or its older guided_json / guided_regex / guided_choice / guided_grammar. Two are a 400."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    try:
        fmt = structured_outputs_for(req.response_format)
    except StructuredOutputError as e:
        raise bad(str(e), "response_format", "invalid_response_format") from None
    if fmt is not None:
        given.append(("response_format", fmt))
    so = req.structured_outputs
    if so is not None:
        spec = StructuredOutputsParams(
            json=so.json_schema, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object)
        )
        given.append(("structured_outputs", spec))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if getattr(req, name) is not None:
            given.append((name, StructuredOutputsParams(**{key: getattr(req, name)})))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", StructuredOutputsParams(grammar=req.guided_grammar)))
    if len(given) > 1:
        names = ", ".join(n for n, _ in given)
        raise bad(f"give at most one output constraint, got {names}", given[1][0])
    if not given:
        return None
    name, spec = given[0]
    try:
        spec = spec.validate()
    except ValueError as e:
        raise bad(str(e).replace("structured_outputs", name, 1), name, "invalid_response_format") from None
    error = grammar_error(spec)  # a bad regex, schema or grammar: named here, as the batch jobs name it
    if error is not None:
        raise bad(f"{name}: cannot be enforced: {error}", name, "invalid_response_format")
    return spec


def _param_of(message: str, req: SamplingRequest) -> str | None:
    word = message.split(" ", 1)[0]
    if word not in _FIELDS:
        return None
    if isinstance(req, ChatCompletionRequest):
        if word == "logprobs":
            return "top_logprobs"
        if word == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
    return word


def check_logprob_counts(req: SamplingRequest) -> None:
    """vLLM's rules for logprob counts beyond SamplingParams' range check: -1 (every token of the vocabulary) is
    refused here by name, and prompt_logprobs above 0 cannot be streamed (no chunk carries them, as in vLLM)."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        v = getattr(req, name, None)
        if v == -1 and not isinstance(v, bool):
            raise bad(
                f"{name} -1 (logprobs of the whole vocabulary) is not supported; ask for at most {MAX_LOGPROBS}", name
            )
    if req.stream and req.prompt_logprobs:
        raise bad("prompt_logprobs are not available with stream=true (as in vLLM)", "prompt_logprobs")


def sampling_params(
    engine: LLMEngine, req: SamplingRequest, num_logprobs: int | None, prompt_lens: list[int]
) -> SamplingParams:
    """SamplingParams validated against the model; max_tokens must leave every prompt inside the context.
    A constraint's grammar is compiled when the engine admits the request (StructuredOutputError: 400)."""
    sp = req.sampling_params(num_logprobs)
    sp.structured_outputs = structured_outputs_of(req)
    try:
        check_priority(req.priority, engine.config.scheduler.scheduling_policy)
    except ValueError as e:
        raise bad(str(e), "priority") from None
    try:
        sp.validate(engine.vocab_size, engine.config.max_logprobs)
    except ValueError as e:
        msg, param = str(e), _param_of(str(e), req)
        word = msg.split(" ", 1)[0]
        if param is not None and param != word:  # the request's name for the field (chat: top_logprobs)
            msg = param + msg[len(word) :]
        raise bad(msg, param) from None
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    for n in prompt_lens:
        try:
            check_context_length(n, sp.max_tokens, engine.max_model_len, param)
        except ContextLengthError as e:
            where = (
                e.param if e.param != "prompt" else "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            )
            raise bad(str(e), where, "context_length_exceeded") from None
    return sp


INT64 = (-(2**63), 2**63 - 1)


def check_request_fields(req: SamplingRequest) -> None:
    """vLLM's 400s for fields the protocol models accept alone: stream_options without stream=true, and a seed
    outside int64."""
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options can only be given with stream=true", "stream_options")
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise bad(f"seed must be a 64-bit signed integer, in [{INT64[0]}, {INT64[1]}]", "seed")


def completion_checks(req: CompletionRequest) -> None:
    check_request_fields(req)
    check_logprob_counts(req)
    if req.suffix:
        raise bad("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad(f"best_of ({req.best_of}) must equal n ({req.n}): ranking extra samples is not supported", "best_of")


def chat_checks(req: ChatCompletionRequest) -> int | None:
    """The number of top logprobs (None: no logprobs). Tools and tool_choice are serving.tool_choice's."""
    check_request_fields(req)
    check_logprob_counts(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs requires logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None
