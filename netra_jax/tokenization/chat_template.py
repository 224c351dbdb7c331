"""Chat templates: render Hugging Face-style Jinja chat templates in a bounded, immutable sandbox.
Checks the messages, mirrors transformers' environment (filters, globals, tags) and limits size and time."""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_DEADLINE: ContextVar[float] = ContextVar("chat_template_deadline", default=math.inf)
_PRINTF_WIDTH = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")


class ChatTemplateError(ValueError):
    """A chat template is missing, unsafe, too costly, or failed to render for the given messages."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template (base models usually have none) and none was given. The message is one sentence
    saying so, then `hint`: what the caller's user can do about it (a flag, an argument, another endpoint)."""

    BASE = "the model has no chat template (a base model?), so it cannot answer chat requests"

    def __init__(self, hint: str) -> None:
        super().__init__(self.message(hint))
        self.hint = hint

    @classmethod
    def message(cls, hint: str) -> str:
        return f"{cls.BASE}; {hint}"

    def __reduce__(self) -> tuple[type, tuple[str]]:  # pickled (Ray workers) from its hint, not its whole message
        return type(self), (self.hint,)


@dataclass(frozen=True)
class ChatTemplateLimits:
    """Bounds on one rendering. Jinja's sandbox alone bounds neither time nor memory; these do.

    `timeout_s` is checked on every loop iteration and every call (macros included), the only ways a
    template can run long, so rendering stops within about that time. `max_output_chars` bounds the rendered
    text and every string or list the template builds (`+`, `~`, `*`, `%`, calls and filters); jinja2 caps
    `range()` at 100 000 items. `lipsum` is removed from the globals.
    """

    max_template_chars: int = 256_000
    max_output_chars: int = 4_000_000
    timeout_s: float = 2.0


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers), rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:  # `a ~ b`: route through a size check
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _size(value: Any) -> int:
    """Characters or items a value holds, one level deep (a list of strings counts its strings)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    if isinstance(value, (dict, set, frozenset)):
        return len(value)
    return 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    max_chars = ChatTemplateLimits.max_output_chars
    timeout_s = ChatTemplateLimits.timeout_s

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every `{% for %}` iterates through bounded_iter
            loop.iter = nodes.Filter(loop.iter, "_bounded_iter", [], [], None, None, lineno=loop.lineno)
        return tree

    def check_deadline(self) -> None:
        if time.monotonic() > _DEADLINE.get():
            raise ChatTemplateError(f"chat template did not finish within {self.timeout_s} s")

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.check_deadline()
            yield item

    def _check_args(self, what: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        values = [*args, *kwargs.values()]
        if any(isinstance(v, int) and abs(v) > self.max_chars for v in values):
            raise ChatTemplateError(f"chat template passed a number above {self.max_chars} to {what}")
        if sum(_size(v) for v in values) > self.max_chars:
            raise ChatTemplateError(f"chat template passed more than {self.max_chars} characters to {what}")

    def _check_result(self, what: str, value: Any) -> Any:
        if _size(value) > self.max_chars:
            raise ChatTemplateError(f"chat template built a value over {self.max_chars} characters with {what}")
        return value

    def bounded_concat(self, parts: Sequence[Any]) -> str:
        return self._check_result("'~'", "".join(map(str, parts)))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept fast
            if len(left) + len(right) > self.max_chars:
                raise ChatTemplateError(f"chat template concatenation exceeds {self.max_chars} characters")
            return left + right
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and _size(seq) * max(n, 0) > self.max_chars:
                raise ChatTemplateError(f"chat template repetition exceeds {self.max_chars} characters")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * left.bit_length() > 4096:
                raise ChatTemplateError("chat template power is too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and _size(left) + _size(right) > self.max_chars:
                raise ChatTemplateError(f"chat template concatenation exceeds {self.max_chars} characters")
        elif operator == "%" and isinstance(left, str):
            widths = [int(w) for m in _PRINTF_WIDTH.finditer(left) for w in m.groups() if w]
            self._check_args("'%'", widths, {})
            self._check_args("'%'", right if isinstance(right, tuple) else (right,), {})
        return self._check_result(f"'{operator}'", super().call_binop(context, operator, left, right))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:  # fail at once, not when the value is used
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.check_deadline()
        __self._check_args(getattr(__obj, "__name__", "a call"), args, kwargs)
        return __self._check_result("a call", super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(env: _BoundedEnvironment, name: str, func: Any) -> Any:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        env._check_args(f"filter {name!r}", args, kwargs)
        return env._check_result(f"filter {name!r}", func(*args, **kwargs))

    return wrapper


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' override: no HTML escaping, same keyword arguments
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str, limits: ChatTemplateLimits) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.max_chars, env.timeout_s = limits.max_output_chars, limits.timeout_s
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(env, name, f) for name, f in env.filters.items()}
    env.filters["_bounded_iter"] = env.bounded_iter
    del env.globals["lipsum"]  # unbounded text generator, used by no chat template
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and return copies whose `content` is a string (text parts joined with newlines).

    Each message is a dict with a string `role` and a `content` that is a string, a list of
    `{"type": "text", "text": ...}` parts, or None on an assistant message that carries `tool_calls`.
    Other keys (name, tool_calls, tool_call_id, reasoning_content...) pass through unchanged.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"messages[{i}]['content'][{j}] must be {{'type': 'text', 'text': str}}, got {part!r}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            if not msg.get("tool_calls"):
                raise ValueError(f"messages[{i}] has no 'content' (allowed only on a message with 'tool_calls')")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of text parts, got {content!r}")
        out.append({**msg, "content": content})
    return out


def _render_bounded(compiled: jinja2.Template, variables: dict[str, Any], limits: ChatTemplateLimits) -> str:
    chunks, total = [], 0
    token = _DEADLINE.set(time.monotonic() + limits.timeout_s)
    try:
        for chunk in compiled.generate(**variables):
            total += len(chunk)
            if total > limits.max_output_chars:
                raise ChatTemplateError(f"chat template output exceeds {limits.max_output_chars} characters")
            chunks.append(chunk)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except Exception as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
    finally:
        _DEADLINE.reset(token)
    return "".join(chunks)


def render_chat_template(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    limits: ChatTemplateLimits = ChatTemplateLimits(),
    **kwargs: Any,
) -> str:
    """Render `messages` the way transformers' `apply_chat_template(tokenize=False)` does.

    Template variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
    (`bos_token`, `eos_token`... only those that are set) and any extra keyword arguments.
    """
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("chat template must be a non-empty string")
    if len(template) > limits.max_template_chars:
        raise ChatTemplateError(f"chat template is {len(template)} characters, above {limits.max_template_chars}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    msgs = normalize_messages(messages)
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and (not isinstance(value, Sequence) or not all(isinstance(v, Mapping) for v in value)):
            raise ValueError(f"{name} must be a list of dicts")
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables.update(messages=msgs, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
    text = _render_bounded(_compile(template, limits), variables, limits)
    if continue_final_message:  # cut after the final message's text so generation continues it
        final = msgs[-1]["content"] or ""
        if not final.strip() or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the final message's text does not appear in the output")
        loc = text.rindex(final.strip())
        keep = len(final.lstrip()) if text[loc : loc + len(final.lstrip())] == final else len(final.strip())
        text = text[: loc + keep]
    return text
