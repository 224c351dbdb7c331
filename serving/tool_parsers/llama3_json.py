"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls: an answer that starts (after an optional `<|python_tag|>`) with
`{"name": ..., "parameters": {...}}` objects separated by `;` is tool calls; any other answer is content."""

from __future__ import annotations

from collections.abc import Callable

from netra_jax.serving.tool_parsers.base import ToolParser
from netra_jax.serving.tool_parsers.json_call import JsonCall

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """States: `start` (deciding), `text` (all content), `sep` (between calls: blanks and `;`), `call`, `rest`
    (text after the calls: content). An answer whose first object is not a call is content, whole."""

    name = "llama3_json"
    tags = (PYTHON_TAG,)

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        super().__init__(make_id)
        self._state = "start"
        self._raw = ""  # text since the start of the answer (or of the current call), while it may be content
        self._call: JsonCall | None = None

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "start":
                body = buf.lstrip()
                if body.startswith(PYTHON_TAG):
                    body = body[len(PYTHON_TAG) :]
                elif not body or (PYTHON_TAG.startswith(body) and not final):
                    if final:
                        self.emit_content(buf)
                        self._buf = ""
                    return
                elif body[0] != "{":
                    self._state = "text"
                    continue
                self._raw, self._buf, self._state = buf[: len(buf) - len(body)], body, "sep"
            elif self._state == "sep":
                body = buf.lstrip(" \t\r\n;")
                self._raw += buf[: len(buf) - len(body)]
                self._buf = body
                if not body:
                    return
                if body[0] != "{":
                    self._state = "rest" if self.num_calls else "text"
                    self._buf = body if self.num_calls else self._raw + body
                    continue
                self._call, self._state = JsonCall(self, ("parameters", "arguments")), "call"
                if self.num_calls:
                    self._raw = ""
            elif self._state == "call":
                call = self._call
                taken = call.feed(buf)
                self._raw += buf[:taken]
                self._buf = buf[taken:]
                if call.done:
                    self._state = "sep"
                elif call.invalid and not call.named:
                    self._state = "rest" if self.num_calls else "text"
                    self._buf = self._raw + self._buf
                elif call.invalid:
                    self._state = "rest"
                elif final:
                    if call.named:
                        call.close()
                    else:
                        self.emit_content(self._raw)
                    return
                else:
                    return
            else:  # text, rest
                self.emit_content(buf)
                self._buf = ""
                return
