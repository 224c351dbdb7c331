"""OpenAI request bodies -> engine prompts and SamplingParams, and engine outputs -> chat.completion /
text_completion response bodies, for batch jobs (the same JSON shapes the HTTP server answers with)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError as PydanticValidationError

from netra_jax.chat_template import NoChatTemplateError
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving.protocol import ResponseFormat
from netra_jax.serving.structured import structured_outputs_for

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine
    from netra_jax.engine.outputs import RequestOutput

# body keys mapped 1:1 onto SamplingParams fields (vLLM's extensions included)
_SAMPLING_KEYS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream", "stream_options")  # checked or no effect
_CHAT_KEYS = {
    *_SAMPLING_KEYS,
    *_IGNORED,
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "chat_template_kwargs",
    "add_generation_prompt",
}
_COMPLETION_KEYS = {*_SAMPLING_KEYS, *_IGNORED, "prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of"}
MAX_PROMPTS = 256  # prompts in one /v1/completions request


class RequestError(ValueError):
    """A request the server would refuse: HTTP `status`, OpenAI error `code`, the offending `param`."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class ChatJob:
    """One batch request on its way through the engine: a chat conversation or one or more completion prompts."""

    work: Any
    chat: bool
    prompts: list[tuple[Any, SamplingParams]]
    n: int = 1
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text, put before its output
    top_logprobs: int | None = None  # chat: alternatives per token when logprobs are on
    rids: list[str] = field(default_factory=list)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.n * len(self.prompts)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sampling(body: dict[str, Any], chat: bool, vocab_size: int) -> SamplingParams:
    kw = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if chat:
        kw["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))  # None: up to the context
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError(f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
        if top is not None and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if logprobs:
            kw["logprobs"] = 0 if top is None else top
    else:
        kw["max_tokens"] = body.get("max_tokens", 16)  # OpenAI's default for completions
        if body.get("logprobs") is not None:
            kw["logprobs"] = body["logprobs"]
    if body.get("response_format") is not None:  # same mapping as the server; compiled when the engine admits it
        try:
            kw["structured_outputs"] = structured_outputs_for(ResponseFormat.model_validate(body["response_format"]))
        except (ValueError, PydanticValidationError) as e:
            raise RequestError(f"invalid response_format: {e}", param="response_format") from e
    try:
        return SamplingParams(**kw).validate(vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from e


def _message_text(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _chat_prompt(body: dict[str, Any], engine: LLMEngine) -> dict[str, Any]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", param="messages")
    conv = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", param="messages")
        conv.append({**m, "content": _message_text(m.get("content"), i)})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    add_gen = body.get("add_generation_prompt", True)
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(conv, add_generation_prompt=add_gen, **kwargs)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    except NoChatTemplateError:
        raise RequestError(
            NoChatTemplateError.message("send completion requests (/v1/completions) instead"),
            code="no_chat_template",
            param="messages",
        ) from None
    except Exception as e:  # template errors of any kind are the request's problem
        raise RequestError(f"could not apply the chat template: {e}", param="messages") from e


def _completion_prompts(body: dict[str, Any]) -> list[Any]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return [{"prompt_token_ids": p}]
    if isinstance(p, list) and p and len(p) <= MAX_PROMPTS:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
            return [{"prompt_token_ids": x} for x in p]
    raise RequestError(
        f"prompt must be a string, a list of token ids, or a non-empty list of either (at most {MAX_PROMPTS})",
        param="prompt",
    )


def prepare(work: Any, engine: LLMEngine, model_name: str, chat: bool) -> ChatJob:
    """Validate a request body against the served model; RequestError names what is wrong."""
    body = work.body
    allowed = _CHAT_KEYS if chat else _COMPLETION_KEYS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(f"unsupported parameter {unknown[0]!r}", param=unknown[0])
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(
            f"the model {model!r} does not exist; this batch serves {model_name!r}",
            status=404,
            code="model_not_found",
            param="model",
        )
    if body.get("stream"):
        raise RequestError("stream is not supported in batch requests", param="stream")
    sp = _sampling(body, chat, engine.vocab_size)
    if chat:
        return ChatJob(work, True, [(_chat_prompt(body, engine), sp)], n=sp.n, top_logprobs=sp.logprobs)
    if body.get("suffix"):
        raise RequestError("suffix is not supported", param="suffix")
    if body.get("best_of") is not None and body["best_of"] != sp.n:
        raise RequestError("best_of must equal n", param="best_of")
    echo = body.get("echo", False)
    if not isinstance(echo, bool) or (echo and sp.logprobs is not None):
        raise RequestError("echo must be a boolean and cannot be combined with logprobs", param="echo")
    prompts = _completion_prompts(body)
    texts = None
    if echo:
        try:
            texts = [p if isinstance(p, str) else engine.tokenizer.decode(p["prompt_token_ids"]) for p in prompts]
        except ValueError as e:
            raise RequestError(str(e), param="prompt") from e
    return ChatJob(work, False, [(p, sp.clone()) for p in prompts], n=sp.n, echo_texts=texts)


# ---------------------------------------------------------------------- response bodies
def _token(lp) -> str:
    return lp.decoded_token or ""


def _chat_logprobs(entries, k: int) -> dict[str, Any]:
    content = []
    for entry in entries:
        lp = next(iter(entry.values()))  # the sampled token comes first
        top = sorted((v for v in entry.values() if v.rank is not None and v.rank <= k), key=lambda v: v.rank)
        content.append(
            {
                "token": _token(lp),
                "logprob": lp.logprob,
                "bytes": list(_token(lp).encode()),
                "top_logprobs": [
                    {"token": _token(v), "logprob": v.logprob, "bytes": list(_token(v).encode())} for v in top
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(entries) -> dict[str, Any]:
    tokens, token_lps, tops, offsets, off = [], [], [], [], 0
    for entry in entries:
        lp = next(iter(entry.values()))
        tokens.append(_token(lp))
        token_lps.append(lp.logprob)
        tops.append({_token(v): v.logprob for v in entry.values()})
        offsets.append(off)
        off += len(_token(lp))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def response_body(job: ChatJob, outs: list[RequestOutput], model_name: str) -> dict[str, Any]:
    """The chat.completion or text_completion object (with usage) for a finished job."""
    choices = []
    for p, out in enumerate(outs):
        for c in out.outputs:
            base = {"index": p * job.n + c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if job.chat:
                lps = _chat_logprobs(c.logprobs, job.top_logprobs or 0) if c.logprobs is not None else None
                choices.append(
                    {**base, "message": {"role": "assistant", "content": c.text, "refusal": None}, "logprobs": lps}
                )
            else:
                text = (job.echo_texts[p] if job.echo_texts else "") + c.text
                lps = _completion_logprobs(c.logprobs) if c.logprobs is not None else None
                choices.append({**base, "text": text, "logprobs": lps})
    choices.sort(key=lambda c: c["index"])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }
