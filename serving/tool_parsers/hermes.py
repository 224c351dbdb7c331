"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 tool calls, each a JSON object between `<tool_call>` and
`</tool_call>` (`{"name": ..., "arguments": {...}}`), any number per answer, with content around them."""

from __future__ import annotations

from collections.abc import Callable

from netra_jax.serving.tool_parsers.base import ToolParser, held_prefix
from netra_jax.serving.tool_parsers.json_call import JsonCall

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """States: `text` (content), `open` (after `<tool_call>`, before the object), `call` (in the object), `tail`
    (object done: skip to `</tool_call>`), `bad` (not a call after all: its text, tags included, is content).
    A closing tag outside the call's JSON strings ends it even before the object closes; a body that is not an
    object with a string `name` is content, tags included."""

    name = "hermes"
    tags = (START, END)

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        super().__init__(make_id)
        self._state = "text"
        self._raw = ""  # the current call's text from its opening tag, while it may still turn out to be content
        self._call: JsonCall | None = None

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "text":
                if not self.text_until(START, final):
                    return
                self._raw, self._state = START, "open"
            elif self._state == "open":
                body = buf.lstrip()
                self._raw += buf[: len(buf) - len(body)]
                self._buf = body
                if not body:
                    if final:
                        self.emit_content(self._raw)
                    return
                if body[0] == "{":
                    self._call, self._state = JsonCall(self), "call"
                else:
                    self._state = "bad"
            elif self._state == "call":
                if not self._in_call(final):
                    return
            elif self._state == "tail":
                j = buf.find(END)
                if j < 0:
                    self._buf = "" if final else buf[len(buf) - held_prefix(buf, (END,)) :]
                    return
                self._buf, self._state = buf[j + len(END) :], "text"
            else:  # bad
                j = buf.find(END)
                if j < 0:
                    if final:
                        self.emit_content(self._raw + buf)
                        self._buf = ""
                    return
                self.emit_content(self._raw + buf[: j + len(END)])
                self._buf, self._state = buf[j + len(END) :], "text"

    def _in_call(self, final: bool) -> bool:
        """Feed the call what text it may have; True when the state changed (the loop goes on). A closing tag
        inside one of the call's JSON strings is text of the call (an argument may quote the tag)."""
        call = self._call
        while True:
            buf = self._buf
            end = buf.find(END)
            chunk = buf if end < 0 else buf[:end]
            if end < 0 and not final:
                chunk = chunk[: len(chunk) - held_prefix(chunk, (END,))]
            taken = call.feed(chunk)
            self._raw += chunk[:taken]
            self._buf = buf[taken:]
            if end < 0 or call.done or call.invalid or not call.in_string:
                break
            call.feed(END)
            self._raw += END
            self._buf = self._buf[len(END) :]
        if call.done or (call.invalid and call.named):
            self._state = "tail"
        elif call.invalid:
            self._state = "bad"
        elif end >= 0 or final:  # the closing tag (or the end of the output) came before the object closed
            if call.named:
                call.close()
                self._buf = self._buf[len(END) :] if end >= 0 else ""
                self._state = "text"
            else:
                self._state = "bad"
        else:
            return False
        return True
