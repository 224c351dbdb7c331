"""Griffe extension for the documentation build: an attribute without a docstring takes its comment as one, the
comment on its own line (`page_size: int = 16  # tokens per KV page`) or else the comment lines right above it.

The project documents dataclass fields and array shapes in comments; this renders them in the API reference.
Named in mkdocs.yml's mkdocstrings `extensions`."""

from __future__ import annotations

import ast
import io
import tokenize
from typing import Any

import griffe

_PRAGMAS = ("noqa", "type:", "fmt:", "pragma", "ruff:")


def comments(code: str) -> tuple[dict[int, str], dict[int, str]]:
    """(trailing, standalone): line number -> comment text without the '#', for comments after code on their line
    and for comments alone on theirs. Tool pragmas (noqa, type:, fmt:, ...) are left out."""
    trailing: dict[int, str] = {}
    standalone: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if not text or text.startswith(_PRAGMAS):
            continue
        line = tok.start[0]
        (trailing if tok.line[: tok.start[1]].strip() else standalone)[line] = text
    return trailing, standalone


def field_comment(node: ast.AST, trailing: dict[int, str], standalone: dict[int, str]) -> str | None:
    """The comment documenting the assignment `node`: the one ending its last line, else the block of comment
    lines directly above its first line; None when there is neither."""
    if (text := trailing.get(node.end_lineno)) is not None:
        return text
    above = []
    line = node.lineno - 1
    while line in standalone:
        above.append(standalone[line])
        line -= 1
    return " ".join(reversed(above)) or None


class FieldComments(griffe.Extension):
    """Give comment-documented attributes (module, class and instance) their comment as docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._cache: dict[str, tuple[dict[int, str], dict[int, str]]] = {}

    def on_attribute_instance(
        self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute, agent: Any, **kwargs: Any
    ) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AST) or not isinstance(agent, griffe.Visitor):
            return
        key = str(agent.filepath)
        if key not in self._cache:
            self._cache[key] = comments(agent.code)
        text = field_comment(node, *self._cache[key])
        if text is not None:
            attr.docstring = griffe.Docstring(
                text,
                lineno=node.lineno,
                endlineno=node.end_lineno,
                parent=attr,
                parser=agent.docstring_parser,
                parser_options=agent.docstring_options,
            )
