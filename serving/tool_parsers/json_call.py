"""One tool call written as JSON, fed piece by piece as the model writes it: a resumable scan of the object that
reports the call's name once complete and its arguments' text as it arrives (the shared core of every parser)."""

from __future__ import annotations

import json
from typing import Protocol

_SPACE = " \t\r\n"


class CallSink(Protocol):
    """Where a JsonCall sends what it finds (a ToolParser): a new call's name, then pieces of its arguments."""

    def call_name(self, name: str) -> None: ...

    def call_arguments(self, text: str) -> None: ...


def arguments_text(raw: str) -> str:
    """A complete arguments value that is not written as an object, as the text of a JSON object: a JSON string
    holding an object's text (some models quote their arguments) is that text; null or any other value is `{}`."""
    try:
        value = json.loads(raw)
    except ValueError:
        return "{}"
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return "{}"
        return value.strip() if isinstance(inner, dict) else "{}"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else "{}"


class JsonCall:
    """Scans `{"name": "f", "arguments": {...}}` (any member order; `arg_keys` name the arguments member) and
    reports the name when its string is complete, then the arguments object's text verbatim as it grows.

    With `name` given the whole object is the arguments (Mistral's `name[ARGS]{...}`, a named tool choice).
    `feed` returns how many of the given characters belong to the object: it stops after the closing brace
    (`done`) or before a character that cannot continue it (`invalid`)."""

    def __init__(
        self, sink: CallSink, arg_keys: tuple[str, ...] = ("arguments", "parameters"), name: str | None = None
    ):
        self.sink = sink
        self.arg_keys = arg_keys
        self.text = ""  # the text fed so far (blanks, then the object)
        self.opened: int | None = None  # where the object's opening brace is
        self.pos = 0  # characters of `text` scanned
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect = "open"  # open, key, colon, value, literal, after (what may come next at depth 1)
        self.key: str | None = None
        self.start = 0  # where the current key or depth-1 value starts
        self.literal_end = 0
        self.values: dict[str, list[int | None]] = {}  # depth-1 member -> [start, end or None while open]
        self.done = False
        self.invalid = False
        self.args_only = name is not None
        self.name = name
        self.named = False  # the name has gone to the sink
        self.args_key: str | None = None
        self.args_sent = 0  # characters of the arguments' text sent
        self.args_done = False

    # ------------------------------------------------------------------ scanning
    def feed(self, text: str) -> int:
        """Scan `text` as the object's continuation; returns how many of its characters the object took."""
        if self.done or self.invalid:
            return 0
        base = len(self.text)
        self.text += text
        stop = self._scan()
        taken = stop - base
        self.text = self.text[:stop]
        self._report()
        return taken

    def _scan(self) -> int:
        text = self.text
        i = self.pos
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 1 and not self.args_only:
                        if not self._string_closed(i):
                            return self._fail(i)
            elif self.expect == "literal" and (c in ",}" or c in _SPACE):
                if c not in _SPACE:
                    self._value_end(self.literal_end)
                    continue  # the ',' or '}' is handled as what follows the value
            elif c in _SPACE:
                pass
            elif self.depth == 0:
                if c != "{":
                    return self._fail(i)
                self.depth, self.expect, self.opened = 1, "key", i
            elif self.depth > 1 or self.args_only:
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        return self._close(i)
                    if self.depth == 1 and not self.args_only:
                        self._value_end(i + 1)
            elif not self._member_char(c, i):
                return self._fail(i)
            elif self.done:
                return self._close(i)
            i += 1
            self.pos = i
        self.pos = i
        return i

    def _member_char(self, c: str, i: int) -> bool:
        """A character at depth 1 of a call object (outside strings); False if it cannot be there."""
        if self.expect == "key":
            if c == "}":
                self.done = True
            elif c == '"':
                self.in_string, self.start = True, i
            else:
                return False
        elif self.expect == "colon":
            if c != ":":
                return False
            self.expect = "value"
        elif self.expect == "value":
            self.start = i
            self.values[self.key] = [i, None]
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth = 2
            else:
                self.expect, self.literal_end = "literal", i + 1
                return c not in "]}:,"
        elif self.expect == "literal":
            self.literal_end = i + 1
        elif self.expect == "after":
            if c == ",":
                self.expect = "key"
            elif c == "}":
                self.done = True
            else:
                return False
        return True

    def _string_closed(self, i: int) -> bool:
        if self.expect == "key":
            try:
                self.key = json.loads(self.text[self.start : i + 1])
            except ValueError:
                return False
            self.expect = "colon"
        else:
            self._value_end(i + 1)
        return True

    def _value_end(self, end: int) -> None:
        self.values[self.key][1] = end
        self.expect = "after"

    def _close(self, i: int) -> int:
        self.done = True
        self.pos = i + 1
        return i + 1

    def _fail(self, i: int) -> int:
        self.invalid = True
        self.pos = i
        return i

    # ------------------------------------------------------------------ reporting
    def _report(self) -> None:
        if self.name is None and not self.args_only:
            self._find_name()
        if self.name is None or self.opened is None:
            return
        if not self.named:
            self.sink.call_name(self.name)
            self.named = True
        self._report_arguments()
        if self.invalid:
            self.close()

    def _find_name(self) -> None:
        span = self.values.get("name")
        if span is not None and span[1] is not None:
            raw = self.text[span[0] : span[1]]
            try:
                name = json.loads(raw) if raw[0] == '"' else None
            except ValueError:  # a bad escape
                name = None
            if isinstance(name, str) and name:
                self.name = name
                return
        elif not self.done:
            return
        self.invalid, self.done = True, False  # an object, but not a call: its text is the parser's to place

    def _report_arguments(self) -> None:
        if self.args_only:
            start, end = self.opened, self.pos
        else:
            if self.args_key is None:
                self.args_key = next((k for k in self.values if k in self.arg_keys), None)
                if self.args_key is None:
                    if self.done:
                        self._send("{}", done=True)
                    return
            start, end = self.values[self.args_key]
            if self.text[start] != "{":
                if end is not None and not self.args_done:
                    self._send(arguments_text(self.text[start:end]), done=True)
                return
            end = self.pos if end is None else end
        self._send(self.text[start + self.args_sent : end], done=False)

    def _send(self, text: str, done: bool) -> None:
        if text:
            self.sink.call_arguments(text)
            self.args_sent += len(text)
        self.args_done = self.args_done or done

    def close(self) -> None:
        """The output ended inside the object (max_tokens, or a closing tag came early): a call whose name was
        sent and has no arguments yet gets `{}`; partial arguments stay as written (OpenAI's truncated calls)."""
        if self.named and self.args_sent == 0 and not self.args_done:
            self._send("{}", done=True)
