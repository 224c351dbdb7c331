"""Reasoning parsers (vLLM's --reasoning-parser names): split a model's `<think>...</think>` thinking from its
answer, for a whole output and for streamed pieces, into reasoning_content and content."""

from __future__ import annotations

from typing import ClassVar

from netra_jax.serving.tool_parsers.base import held_prefix


class ReasoningParser:
    """One choice's reasoning parser. `prompt`: the rendered prompt; a template that ends it with the start tag
    opened the block (the output starts inside it), one that ends it with the end tag closed it (Qwen3's
    `enable_thinking=False`: the output is all answer). `constrained`: a grammar writes the output from its first
    token, so it is thinking only if it writes the start tag itself (a forced tool call or JSON is the answer).

    States: `before` (has the thinking begun?), `opening` (thinking by default; skip an optional start tag),
    `think` (until the end tag), `answer`. Tags are held back until decided, never sent half."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    thinks_by_default: ClassVar[bool] = False  # output without a start tag is thinking (until an end tag)

    def __init__(self, prompt: str = "", constrained: bool = False) -> None:
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            self._state = "answer"
        elif constrained:
            self._state = "before"
        elif tail.endswith(self.start) or self.thinks_by_default:
            self._state = "opening"
        else:
            self._state = "before"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of the output; returns the (reasoning, content) text that can be sent now."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None when empty."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            buf = self._buf
            if self._state in ("before", "opening"):
                body = buf.lstrip()
                if body.startswith(self.start):
                    self._buf, self._state = body[len(self.start) :], "think"
                elif not final and self.start.startswith(body):
                    break
                else:
                    self._state = "answer" if self._state == "before" else "think"
            elif self._state == "think":
                i = buf.find(self.end)
                if i < 0:
                    keep = 0 if final else held_prefix(buf, (self.end,))
                    reasoning.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                reasoning.append(buf[:i])
                self._buf, self._state = buf[i + len(self.end) :], "answer"
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: thinking only inside `<think>...</think>` (an answer without the start tag is all content); a block
    left open by the end of the output (max_tokens) is reasoning."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens the block, so the output is thinking up to `</think>` whether or not it
    repeats `<think>`; an output that never closes it is all reasoning (vLLM's deepseek_r1)."""

    name = "deepseek_r1"
    thinks_by_default = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None
