"""`mistral`: Mistral tool calls after the `[TOOL_CALLS]` token, either a JSON list of `{"name", "arguments"}`
objects (tokenizers before v11) or `name[ARGS]{...}` / `name{...}` per call (v11 and later), with content before
them. Mistral's tool call ids are 9 alphanumerics (mistral-common refuses others in the history)."""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from netra_jax.serving.tool_parsers.base import ToolParser
from netra_jax.serving.tool_parsers.json_call import JsonCall

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


class JsonCallList:
    """A JSON array of call objects (`[{"name": ..., "<arg key>": {...}}, ...]`) fed in pieces; `feed` returns
    the characters taken, stopping after the closing `]` (`done`) or before text that cannot continue it
    (`invalid`). Used by Mistral's older format and by tool_choice "required"."""

    def __init__(self, sink: ToolParser, arg_keys: tuple[str, ...]) -> None:
        self.sink = sink
        self.arg_keys = arg_keys
        self.state = "open"  # open ([), item ({ or ]), call, next (, or ])
        self.call: JsonCall | None = None
        self.done = False
        self.invalid = False

    def feed(self, text: str) -> int:
        i = 0
        while i < len(text) and not (self.done or self.invalid):
            if self.state == "call":
                i += self.call.feed(text[i:])
                if self.call.done:
                    self.state = "next"
                elif self.call.invalid:
                    self.invalid = True
                continue
            c = text[i]
            if c in " \t\r\n":
                i += 1
            elif self.state == "open" and c == "[":
                self.state, i = "item", i + 1
            elif self.state == "item" and c == "{":
                self.call, self.state = JsonCall(self.sink, self.arg_keys), "call"
            elif self.state == "next" and c == ",":
                self.state, i = "item", i + 1
            elif self.state in ("item", "next") and c == "]":
                self.done, i = True, i + 1
            else:
                self.invalid = True
        return i

    def close(self) -> None:
        if self.call is not None and not self.call.done:
            self.call.close()


class MistralToolParser(ToolParser):
    """States: `text` (content until `[TOOL_CALLS]`), `bot` (after it: a list or a name?), `list`, `name` (up to
    the arguments' `{`), `args`, `after` (a call ended: another `[TOOL_CALLS]`, or content). A call left unclosed
    by the end of the output keeps the arguments written so far (as OpenAI's truncated calls)."""

    name = "mistral"
    tags = (BOT, ARGS)

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        super().__init__(make_id)
        self._state = "text"
        self._name = ""
        self._list: JsonCallList | None = None
        self._call: JsonCall | None = None

    @staticmethod
    def make_id() -> str:
        return mistral_tool_call_id()

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "after":
                body = buf.lstrip()
                if body.startswith(BOT):
                    self._buf, self._state, self._name = body[len(BOT) :], "bot", ""
                elif not final and BOT.startswith(body):
                    return
                else:
                    self._state = "text"
            elif self._state == "text":
                if not self.text_until(BOT, final):
                    return
                self._state, self._name = "bot", ""
            elif self._state == "bot":
                self._buf = buf = buf.lstrip()
                if not buf:
                    return
                if buf[0] == "[":
                    self._list, self._state = JsonCallList(self, ("arguments", "parameters")), "list"
                else:
                    self._state = "name"
            elif self._state == "list":
                taken = self._list.feed(buf)
                self._buf = buf[taken:]
                if self._list.done:
                    self._state = "after"
                elif self._list.invalid:
                    self._list.close()
                    self._state = "text"
                elif final:
                    self._list.close()
                    return
                else:
                    return
            elif self._state == "name":
                j = buf.find("{")
                if j < 0:
                    if final:
                        self.emit_content(BOT + self._name + buf)
                        self._buf = ""
                    else:
                        self._name += buf
                        self._buf = ""
                    return
                name = (self._name + buf[:j]).replace(ARGS, "").strip()
                if not name:
                    self.emit_content(BOT + self._name + buf[:j])
                    self._buf, self._state = buf[j:], "text"
                    continue
                self._call, self._buf, self._state = JsonCall(self, name=name), buf[j:], "args"
            else:  # args
                taken = self._call.feed(buf)
                self._buf = buf[taken:]
                if self._call.done:
                    self._state = "after"
                elif final:
                    self._call.close()
                    return
                else:
                    return
