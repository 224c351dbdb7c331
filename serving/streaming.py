"""Server-sent events in OpenAI's chunk format: `data: {...}` per choice delta (chat opens each choice with a role
chunk), finish_reason on the last one, an optional usage chunk, then `data: [DONE]`. Closing aborts the request."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import to_json

from netra_jax.engine.async_engine import EngineDeadError
from netra_jax.engine.outputs import RequestOutput
from netra_jax.serving.chat_output import ChatOutput
from netra_jax.serving.errors import envelope
from netra_jax.serving.generation import Generation
from netra_jax.serving.metrics import ServerMetrics
from netra_jax.serving.protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
)
from netra_jax.serving.render import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    finish,
    join_logprobs,
    usage,
)

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


@dataclass
class StreamContext:
    id: str
    created: int
    model: str
    n: int
    tokens: TokenText
    num_logprobs: int | None  # None: no logprobs
    include_usage: bool
    continuous_usage: bool
    metrics: ServerMetrics | None = None
    echo: list[str] | None = None  # completions: prompt text per prompt; chat: the echoed final message
    return_token_ids: bool = False
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt is all each choice shows
    skip_special_tokens: bool = True


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


_MARK = "netra-text-delta-mark"  # stands for the text in a template chunk; `to_json` writes it unescaped


class TextChunks:
    """The SSE event of a stream's most frequent chunk, one choice's plain text delta and nothing else (no
    logprobs, finish reason, token ids or usage), without building and serializing a model per token: the chunk
    model `make(index, text)` is serialized once per choice index with a marker for the text, and each event is that
    template with the text JSON-encoded by the same serializer, so the bytes are those `_sse(make(index, text))`
    gives. A template the marker cannot be found in exactly once (an id or model name holding it) is not used."""

    def __init__(self, make: Callable[[int, str], BaseModel]) -> None:
        self._make = make
        self._parts: dict[int, tuple[str, str] | None] = {}

    def __call__(self, index: int, text: str) -> str:
        parts = self._parts.get(index, False)
        if parts is False:
            parts = self._parts[index] = _split(_sse(self._make(index, _MARK)))
        if parts is None:
            return _sse(self._make(index, text))
        head, tail = parts
        return head + to_json(text).decode() + tail


def _split(template: str) -> tuple[str, str] | None:
    mark = to_json(_MARK).decode()
    if template.count(mark) != 1:
        return None
    head, _, tail = template.partition(mark)
    return head, tail


def stream_failure(e: BaseException, metrics: ServerMetrics | None) -> tuple[int, str]:
    """The status and message of an engine failure after a stream began (told in-band): 503 for a dead engine,
    400 for bad input, else 500 (logged; the message names only the exception's type). Counted in `metrics`."""
    status = 503 if isinstance(e, EngineDeadError) else 400 if isinstance(e, ValueError) else 500
    if status >= 500:
        log.error("stream failed: %r", e)
    if metrics is not None:
        metrics.count_error(status)
    msg = str(e) if status < 500 or isinstance(e, EngineDeadError) else f"internal error: {type(e).__name__}"
    return status, msg


def _error_event(e: BaseException, metrics: ServerMetrics | None) -> str:
    status, msg = stream_failure(e, metrics)
    return f"data: {json.dumps(envelope(status, msg))}\n\n"


async def output_events(first: tuple[int, RequestOutput] | None, rest: AsyncIterator[tuple[int, RequestOutput]]):
    """A stream's (prompt index, RequestOutput) events: the first (awaited by the route), then the rest."""
    if first is not None:
        yield first
    async for ev in rest:
        yield ev


async def chat_stream(
    gen: Generation, first, rest, ctx: StreamContext, output: ChatOutput | None = None
) -> AsyncIterator[str]:
    """`output`: how each choice's text is read (reasoning, tool calls); None: all of it is content."""
    readers = None if output is None else [output.choice() for _ in range(ctx.n)]
    sent_lp = [0] * ctx.n
    sent_ids = [0] * ctx.n
    done = [False] * ctx.n

    def model(choices, use=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=use)

    def chunk(choices, use=None) -> str:
        return _sse(model(choices, use))

    text_chunk = TextChunks(lambda j, text: model([ChatStreamChoice(index=j, delta=DeltaMessage(content=text))]))
    plain = not ctx.continuous_usage and not ctx.return_token_ids  # a text delta can take the template

    try:
        for j in range(ctx.n):
            yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
        if ctx.echo:  # vLLM's echo on chat: the final assistant message's text opens each choice
            for j in range(ctx.n):
                yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(content=ctx.echo[0]))])
        async for _, out in output_events(first, rest):
            for o in out.outputs:
                j = o.index
                if done[j]:
                    continue
                lps = None
                if ctx.num_logprobs is not None and o.logprobs is not None:
                    new = o.logprobs[sent_lp[j] :]
                    sent_lp[j] = len(o.logprobs)
                    lps = ChatLogprobs(content=chat_logprobs(new, ctx.tokens, ctx.num_logprobs)) if new else None
                reason, stop_reason = finish(o)
                reader = None if readers is None or readers[j].plain else readers[j]
                if plain and reason is None and lps is None and reader is None:  # all of the text is content
                    if o.delta_text:
                        yield text_chunk(j, o.delta_text)
                    continue
                delta = DeltaMessage(content=o.delta_text) if o.delta_text else None
                if reader is not None:  # a reader may hold text back (a tag in the making) until it decides
                    delta = (reader.finish if reason is not None else reader.feed)(o.delta_text)
                    reason = reader.finish_reason(reason)
                if delta is None and lps is None and reason is None:
                    continue
                choice = ChatStreamChoice(
                    index=j, delta=delta or DeltaMessage(), logprobs=lps, finish_reason=reason, stop_reason=stop_reason
                )
                if ctx.return_token_ids:
                    choice.token_ids = o.token_ids[sent_ids[j] :]
                    sent_ids[j] = len(o.token_ids)
                done[j] = reason is not None
                yield chunk([choice], usage(gen.last) if ctx.continuous_usage else None)
        if ctx.include_usage:
            yield chunk([], usage(gen.last))
        yield DONE
    except Exception as e:  # the engine failed mid-stream: tell the client in-band, then end the stream
        yield _error_event(e, ctx.metrics)
        yield DONE
    finally:
        gen.close()


async def completion_stream(gen: Generation, first, rest, ctx: StreamContext) -> AsyncIterator[str]:
    """Echo without logprobs opens each choice at once; echo with logprobs opens it with the first output that has
    the prompt's logprobs (as vLLM's, together with the first token), holding back the choice's text until then."""
    n_prompts = len(gen.rids)
    total = n_prompts * ctx.n
    sent_lp = [0] * total
    sent_ids = [0] * total
    offset = [0] * total
    done = [False] * total
    echo_lps = ctx.echo is not None and ctx.num_logprobs is not None
    opened = [not echo_lps] * total
    held = [""] * total  # text of a choice not yet opened

    def model(choices, use=None) -> CompletionChunk:
        return CompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=use)

    def chunk(choices, use=None) -> str:
        return _sse(model(choices, use))

    text_chunk = TextChunks(lambda j, text: model([CompletionChoice(index=j, text=text)]))
    plain = not ctx.continuous_usage and not ctx.return_token_ids  # a text delta can take the template

    try:
        if ctx.echo is not None and not echo_lps:
            for j in range(total):
                offset[j] = len(ctx.echo[j // ctx.n])
                yield chunk([CompletionChoice(index=j, text=ctx.echo[j // ctx.n])])
        async for i, out in output_events(first, rest):
            for o in out.outputs:
                j = i * ctx.n + o.index
                if done[j]:
                    continue
                head, head_lps = "", None
                if not opened[j]:
                    if out.prompt_logprobs is None:  # n > 1: a sibling sampled before the prompt's rows were in
                        held[j] += o.delta_text
                        continue
                    head = ctx.echo[i]
                    head_lps = echo_logprobs(
                        out.prompt_token_ids, out.prompt_logprobs, ctx.tokens, ctx.num_logprobs, ctx.skip_special_tokens
                    )
                    offset[j], opened[j] = len(head), True
                text = "" if ctx.echo_only else held[j] + o.delta_text
                held[j] = ""
                lps = None
                if ctx.num_logprobs is not None and o.logprobs is not None and not ctx.echo_only:
                    new = o.logprobs[sent_lp[j] :]
                    sent_lp[j] = len(o.logprobs)
                    if new:
                        lps = completion_logprobs(new, ctx.tokens, ctx.num_logprobs, offset[j])
                        offset[j] = lps.text_offset[-1] + len(lps.tokens[-1])
                lps = join_logprobs(head_lps, lps)
                reason, stop_reason = finish(o)
                if not head and not text and lps is None and reason is None:
                    continue
                if plain and not head and lps is None and reason is None:
                    yield text_chunk(j, text)
                    continue
                choice = CompletionChoice(
                    index=j, text=head + text, logprobs=lps, finish_reason=reason, stop_reason=stop_reason
                )
                if ctx.return_token_ids:
                    choice.token_ids = [] if ctx.echo_only else o.token_ids[sent_ids[j] :]
                    sent_ids[j] = len(o.token_ids)
                done[j] = reason is not None
                yield chunk([choice], usage(gen.last) if ctx.continuous_usage else None)
        if ctx.include_usage:
            yield chunk([], usage(gen.last))
        yield DONE
    except Exception as e:
        yield _error_event(e, ctx.metrics)
        yield DONE
    finally:
        gen.close()
