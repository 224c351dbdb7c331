"""Chat messages and tools as the chat template reads them (transformers' apply_chat_template conventions): text
parts joined, `developer` as `system`, assistant tool calls with their arguments as objects, tool results."""

from __future__ import annotations

import json
from typing import Any

from netra_jax.serving.errors import bad
from netra_jax.serving.protocol import ChatCompletionTool, ChatMessage, ToolCallParam


def _content(m: ChatMessage, i: int) -> str:
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise bad(
                    f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                    f"messages.{i}.content",
                )
            texts.append(part.text)
        return "\n".join(texts)  # as vLLM and transformers join text parts
    if m.content is None:
        if m.role != "assistant":
            raise bad(f"messages[{i}]: content is required for role {m.role!r}", f"messages.{i}.content")
        return ""
    return m.content


def _tool_call(call: ToolCallParam, i: int, j: int) -> dict[str, Any]:
    """A history tool call with its arguments as an object: templates write them with `tojson` (Qwen's do)."""
    args = call.function.arguments
    if isinstance(args, str):
        param = f"messages.{i}.tool_calls.{j}.function.arguments"
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}", param) from None
        if not isinstance(args, dict):
            raise bad(
                f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object's text, "
                f"got {type(args).__name__}",
                param,
            )
    out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def chat_message(m: ChatMessage, i: int) -> dict[str, Any]:
    """`messages[i]` as a template dict; APIError(400) naming the field when it cannot be rendered."""
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m, i)}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise bad(f"messages[{i}]: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        msg["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        msg["reasoning_content"] = m.reasoning_content
    return msg


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Template dicts of a conversation. A `tool` message must answer an assistant message's tool_calls (OpenAI
    refuses a lone one, naming messages[i].role)."""
    out = []
    answering = False  # the messages since the last assistant message with tool_calls are all tool results
    for i, m in enumerate(messages):
        if m.role == "tool" and not answering:
            raise bad(
                f"messages[{i}]: a message with role 'tool' must answer a preceding assistant message's tool_calls",
                f"messages.{i}.role",
            )
        answering = bool(m.tool_calls) if m.role == "assistant" else answering and m.role == "tool"
        out.append(chat_message(m, i))
    return out


def template_tools(tools: list[ChatCompletionTool] | None) -> list[dict[str, Any]] | None:
    """`tools` for apply_chat_template: `{"type": "function", "function": {name, description, parameters}}`."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]
