"""The tool-call parser interface: a parser reads one choice's text, whole or as streamed pieces, and turns it into
content plus tool calls in OpenAI's shapes; whole-output extraction is the streaming parse fed the whole text."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import ClassVar

from netra_jax.serving.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall


def make_tool_call_id() -> str:
    """OpenAI's form of a tool call id: `call_` and 24 random alphanumerics."""
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest end of `text` that could still grow into one of `tags` (held back from the output
    so a half tag such as `<tool_` is never sent as content)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def merge_deltas(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Consecutive pieces of the same call joined into one (a chunk carries one entry per call)."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.id is None:
            fn = last.function or DeltaFunctionCall()
            args = (fn.arguments or "") + ((d.function.arguments or "") if d.function else "")
            last.function = DeltaFunctionCall(name=fn.name, arguments=args)
        else:
            out.append(d.model_copy(deep=True))
    return out


def assemble(deltas: Iterable[DeltaMessage]) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls a client rebuilds from streamed deltas (empty content is None)."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.content:
            content.append(d.content)
        for t in d.tool_calls or ():
            call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or t.id
            if t.function is not None:
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
    tool_calls = [
        ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
        for _, c in sorted(calls.items())
    ]
    return "".join(content) or None, tool_calls


class ToolParser:
    """One choice's tool-call parser (a fresh instance per choice). Subclasses implement `_run(final)`, consuming
    `self._buf` as far as its text decides anything; the base turns what they find into deltas.

    Content outside calls streams as content, except whitespace: held until more content follows, and dropped
    at the end once a call was made, so a whole answer's content is the text around its calls, right-stripped
    (None when empty). `tags`: the markers the parser must see in the text (see chat_output: special tokens)."""

    name: ClassVar[str] = ""
    tags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        if make_id is not None:
            self.make_id = make_id
        self._buf = ""
        self._held_space = ""
        self._content: list[str] = []
        self._calls: list[DeltaToolCall] = []
        self.num_calls = 0

    @staticmethod
    def make_id() -> str:
        return make_tool_call_id()

    # ------------------------------------------------------------------ the interface
    def feed(self, text: str) -> DeltaMessage | None:
        """The next piece of the output; returns what can be sent now (None: nothing yet)."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> DeltaMessage | None:
        """The output ended: whatever was held back is decided now."""
        self._run(final=True)
        if self._held_space and not self.num_calls:
            self._content.append(self._held_space)
        self._held_space = ""
        return self._take()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and tool calls of a whole output (the same parse as streaming, in one piece)."""
        return assemble(d for d in (self.feed(text), self.finish()) if d is not None)

    # ------------------------------------------------------------------ for subclasses
    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def text_until(self, tag: str, final: bool) -> bool:
        """Send the content before `tag` and consume the tag: True once it is found; until then the text that
        cannot be the tag's beginning is sent and False returned."""
        buf = self._buf
        i = buf.find(tag)
        if i < 0:
            keep = 0 if final else held_prefix(buf, (tag,))
            self.emit_content(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self.emit_content(buf[:i])
        self._buf = buf[i + len(tag) :]
        return True

    def emit_content(self, text: str) -> None:
        if not text:
            return
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        if kept:
            self._content.append(kept)

    def call_name(self, name: str) -> None:
        self._calls.append(
            DeltaToolCall(
                index=self.num_calls,
                id=self.make_id(),
                type="function",
                function=DeltaFunctionCall(name=name, arguments=""),
            )
        )
        self.num_calls += 1

    def call_arguments(self, text: str) -> None:
        self._calls.append(DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=text)))

    def _take(self) -> DeltaMessage | None:
        content = "".join(self._content)
        calls = merge_deltas(self._calls)
        self._content, self._calls = [], []
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls or None)
