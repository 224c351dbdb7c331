"""Streamed chunks: a plain text delta written from a pre-serialized template is byte for byte the chunk model's
JSON (escapes, non-ASCII, choice indices, an id holding the template's marker), and whole completion and chat
streams read the same through the template as through the models (the path return_token_ids takes)."""

from __future__ import annotations

import asyncio
import json

import pytest

from netra_jax.engine.outputs import CompletionOutput, RequestOutput
from netra_jax.serving.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
)
from netra_jax.serving.streaming import (
    _MARK,
    DONE,
    StreamContext,
    TextChunks,
    _sse,
    chat_stream,
    completion_stream,
)

TEXTS = [" hello", 'a "quote" and a \\ backslash', "line\nbreak\ttab\r", "\x00\x1f\x7f", "é 😀 \u2028 </script>", " "]


def completion_chunk(rid: str):
    return lambda j, text: CompletionChunk(id=rid, created=7, model="m", choices=[CompletionChoice(index=j, text=text)])


def chat_chunk(rid: str):
    return lambda j, text: ChatCompletionChunk(
        id=rid, created=7, model="m", choices=[ChatStreamChoice(index=j, delta=DeltaMessage(content=text))]
    )


@pytest.mark.parametrize("make", [completion_chunk, chat_chunk])
@pytest.mark.parametrize("rid", ["cmpl-1", f"chatcmpl-{_MARK}", f'req "{_MARK}" {_MARK}'])
def test_template_chunk_is_the_models_json(make, rid):
    chunks = TextChunks(make(rid))
    for j in (0, 3, 0):
        for text in TEXTS:
            assert chunks(j, text) == _sse(make(rid)(j, text))


def _outputs(pieces: list[str], n: int = 1) -> list[RequestOutput]:
    """A request's outputs, one per piece, n samples writing the same pieces; the last one finishes."""
    outs, ids = [], []
    for k, piece in enumerate(pieces):
        ids.append(100 + k)
        done = k == len(pieces) - 1
        samples = [
            CompletionOutput(
                index=i,
                text="".join(pieces[: k + 1]),
                token_ids=list(ids),
                finish_reason="length" if done else None,
                delta_text=piece,
            )
            for i in range(n)
        ]
        outs.append(RequestOutput("r-0", None, [1, 2, 3], samples, finished=done))
    return outs


class _Gen:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self.rids = ["r-0"]
        self.last = [outs[-1]]

    def close(self) -> None:
        pass


def _events(stream_fn, outs, **ctx_kw) -> list[dict]:
    ctx = StreamContext("cmpl-x", 7, "m", len(outs[0].outputs), None, None, False, False, **ctx_kw)

    async def rest():
        for out in outs[1:]:
            yield 0, out

    async def run():
        return [e async for e in stream_fn(_Gen(outs), (0, outs[0]), rest(), ctx)]

    events = asyncio.run(run())
    assert events[-1] == DONE
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize("stream_fn", [completion_stream, chat_stream])
@pytest.mark.parametrize("n", [1, 2])
def test_streams_read_the_same_through_the_template(stream_fn, n):
    outs = _outputs([" The", "", ' "cat"', "\n", " é😀", "."], n)
    fast = _events(stream_fn, outs)
    slow = _events(stream_fn, outs, return_token_ids=True)  # every chunk built from the models
    for event in slow:
        for choice in event["choices"]:
            choice.pop("token_ids", None)  # (chat's role chunk has none)
    assert fast == slow
    key = "text" if stream_fn is completion_stream else "delta"
    finals = [c for e in fast for c in e["choices"] if c["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == list(range(n))
    for j in range(n):
        pieces = [c[key] for e in fast for c in e["choices"] if c["index"] == j]
        text = "".join(p if isinstance(p, str) else p.get("content") or "" for p in pieces)
        assert text == ' The "cat"\n é😀.'
