"""OpenAI Batch JSONL lines: input lines classified into work (or error lines), the resume state read back from an
output file, and the success/error output lines; no engine here (serving.batch runs the work)."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from netra_jax.serving.errors import envelope

CHAT_URL, COMPLETIONS_URL, RESPONSES_URL = "/v1/chat/completions", "/v1/completions", "/v1/responses"
URLS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)
DUPLICATE = "duplicate_custom_id"  # error code of a repeated custom_id (the first occurrence is the one served)


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- output lines
def error_line(
    custom_id: str | None,
    message: str,
    code: str,
    *,
    line: int,
    status: int | None = 400,
    param: str | None = None,
    api_code: str | None = None,
) -> dict[str, Any]:
    """A failed request. `response` is null when no request could be formed (malformed line), else the HTTP error
    the server would have answered (`api_code`: its envelope's code, None where the server gives none, as for a
    validation error); `error` is set in both cases, with the batch error `code`, and names the input line."""
    response = None
    if status is not None:  # the body is the server's error envelope for the same failure
        body = envelope(status, message, param, api_code)
        response = {"status_code": status, "request_id": _rid("req"), "body": body}
    return {
        "id": _rid("batch_req"),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message, "line": line},
    }


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _rid("batch_req"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": _rid("req"), "body": body},
        "error": None,
    }


# ---------------------------------------------------------------------- input lines and resume state
@dataclass
class Work:
    """One well-formed request line, ready for an engine."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"line": self.line, "custom_id": self.custom_id, "url": self.url, "body": self.body})

    @staticmethod
    def from_json(text: str) -> Work:
        d = json.loads(text)
        return Work(d["line"], d["custom_id"], d["url"], d["body"])


@dataclass
class Progress:
    """What an existing output file already holds: served custom_ids, malformed input lines (by number) and
    duplicate-id error lines (counted per id), plus what this pass has met so far."""

    done: set[tuple[str, Any]] = field(default_factory=set)  # ("id", custom_id) | ("line", n)
    dups_written: Counter = field(default_factory=Counter)
    seen: set[str] = field(default_factory=set)
    dups_seen: Counter = field(default_factory=Counter)
    skipped: int = 0

    def note(self, out: dict[str, Any]) -> None:
        cid, err = out.get("custom_id"), out.get("error") or {}
        if cid is None:
            self.done.add(("line", err.get("line")))
        elif err.get("code") == DUPLICATE:
            self.dups_written[cid] += 1
        else:
            self.done.add(("id", cid))


def load_progress(output_path: str | os.PathLike) -> Progress:
    """Read an existing output file for resuming. A truncated last line (a kill mid-write) is cut away; a corrupt
    line before the last one raises ValueError, since resuming past it could duplicate or lose requests."""
    prog = Progress()
    if not os.path.exists(output_path):
        return prog
    with open(output_path, "rb+") as f:
        good, bad, newline = 0, None, False
        for i, raw in enumerate(f, 1):
            if bad is not None:
                if raw.strip():
                    raise ValueError(f"{output_path} line {bad[0]} is corrupt ({bad[1]}); cannot resume from it")
                continue
            if raw.strip():
                try:
                    out = json.loads(raw)
                    if not isinstance(out, dict) or "custom_id" not in out:
                        raise ValueError("not a batch output object")
                except ValueError as e:
                    bad = (i, e)
                    continue
                prog.note(out)
                newline = not raw.endswith(b"\n")  # a complete last line that lacks its newline
            good += len(raw)
        f.truncate(good)
        if newline:
            f.seek(good)
            f.write(b"\n")
    return prog


def classify(line_no: int, raw: bytes, prog: Progress) -> Work | dict[str, Any] | None:
    """One input line -> a Work, an error output line, or None (blank, or already in the output)."""
    if not raw.strip():
        return None
    try:
        req = json.loads(raw)
    except ValueError as e:  # includes invalid UTF-8
        key = ("line", line_no)
        return (
            _skip(prog)
            if key in prog.done
            else error_line(None, f"line {line_no}: invalid JSON: {e}", "invalid_json", line=line_no, status=None)
        )
    cid = req.get("custom_id") if isinstance(req, dict) else None
    if not isinstance(cid, str) or not cid:
        if ("line", line_no) in prog.done:
            return _skip(prog)
        what = "a JSON object" if not isinstance(req, dict) else "a non-empty string custom_id"
        return error_line(
            None, f"line {line_no}: a request line needs {what}", "invalid_request", line=line_no, status=None
        )
    if cid in prog.seen:
        prog.dups_seen[cid] += 1
        if prog.dups_seen[cid] <= prog.dups_written[cid]:
            return _skip(prog)
        return error_line(
            cid,
            f"line {line_no}: custom_id {cid!r} appeared earlier in the file; only the first occurrence is run",
            DUPLICATE,
            line=line_no,
            status=None,
        )
    prog.seen.add(cid)
    if ("id", cid) in prog.done:
        return _skip(prog)
    method, url, body = req.get("method", "POST"), req.get("url"), req.get("body")
    if method != "POST":
        return error_line(
            cid, f"line {line_no}: method must be POST, got {method!r}", "invalid_method", line=line_no, status=405
        )
    if url not in URLS:
        return error_line(
            cid,
            f"line {line_no}: unsupported url {url!r}; supported: {', '.join(URLS)}",
            "invalid_url",
            line=line_no,
            status=404,
        )
    if not isinstance(body, dict):
        return error_line(
            cid, f"line {line_no}: body must be a JSON object", "invalid_request", line=line_no, param="body"
        )
    return Work(line_no, cid, url, body)


def _skip(prog: Progress) -> None:
    prog.skipped += 1
    return None


def read_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from enumerate(f, 1)
