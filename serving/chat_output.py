"""Reading a chat choice's text as vLLM does: thinking into reasoning_content (--reasoning-parser), then tool calls
(--tool-call-parser under tool_choice "auto", or the grammar-written calls of "required" / a named function), the
rest as content; for the whole message and as streamed deltas, which concatenate to the whole message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from netra_jax.sampling_params import SamplingParams
from netra_jax.serving.protocol import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from netra_jax.serving.reasoning import ReasoningParser, get_reasoning_parser
from netra_jax.serving.tool_choice import (
    NamedToolOutput,
    RequiredToolOutput,
    ToolChoicePlan,
    apply_tool_grammar,
    plan_tool_choice,
)
from netra_jax.serving.tool_parsers import ToolParser, assemble, get_tool_parser
from netra_jax.serving.tool_parsers.base import merge_deltas
from netra_jax.tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatOutputConfig:
    """The server's flags for reading chat output (vLLM's names): --enable-auto-tool-choice with
    --tool-call-parser {hermes,llama3_json,mistral}, --reasoning-parser {qwen3,deepseek_r1},
    --exclude-tools-when-tool-choice-none."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def make_id(self) -> Callable[[], str] | None:
        """The tool call ids of the parser's family for every call, grammar-written ones too (a Mistral template
        refuses any but 9 alphanumerics in the history); None: OpenAI's `call_...`."""
        return get_tool_parser(self.tool_call_parser).make_id if self.tool_call_parser else None

    @property
    def auto_tools(self) -> type[ToolParser] | None:
        """The parser of tool_choice "auto" (None unless auto tool choice is enabled, as in vLLM)."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            return None
        return get_tool_parser(self.tool_call_parser)

    def plan_tools(self, req: ChatCompletionRequest) -> ToolChoicePlan:
        """Validate the request's tools and tool_choice against these flags (APIError(400) naming the field)."""
        return plan_tool_choice(req, self.auto_tools is not None, self.exclude_tools_when_tool_choice_none)


def _lost_when_skipped(tokenizer: Tokenizer, tags: Sequence[str]) -> bool:
    """Whether decoding with skip_special_tokens drops one of `tags` (it is a special token of this tokenizer)."""
    for tag in tags:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=True).strip() != tag:
            return True
    return False


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read. `keep_special_tokens`: a parser's tags are special tokens of this
    tokenizer, so they must stay in the text. `make_id`: how tool call ids are made (None: OpenAI's form)."""

    tools: ToolChoicePlan
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    prompt: str = ""
    parallel_tool_calls: bool = True
    keep_special_tokens: bool = False
    make_id: Callable[[], str] | None = None
    constrained: bool = False  # written under a grammar: see `plan`

    @classmethod
    def plan(
        cls,
        config: ChatOutputConfig,
        req: ChatCompletionRequest,
        tools: ToolChoicePlan,
        tokenizer: Tokenizer,
        prompt: str,
        constrained: bool = False,
    ) -> ChatOutput:
        """`constrained`: a grammar (a tool choice's or the request's output constraint) writes the output from its
        first token (vLLM applies it once the reasoning has ended; this engine from the start), so the output is
        thinking only where it opens the thinking block itself, even after a template that opened one."""
        tool_parser = config.auto_tools if tools.mode == "auto" else None
        reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        tags = (*(tool_parser.tags if tool_parser else ()), *((reasoning.start, reasoning.end) if reasoning else ()))
        # vLLM's adjust_request: the parser must see its tags, so special tokens stay in the text (the engine never
        # writes the text of the EOS or stop token that ends a choice)
        keep = req.skip_special_tokens and _lost_when_skipped(tokenizer, tags)
        return cls(
            tools,
            tool_parser,
            reasoning,
            prompt,
            req.parallel_tool_calls is not False,
            keep,
            config.make_id,
            constrained,
        )

    def adjust(self, params: SamplingParams) -> None:
        """The engine side of this plan: the grammar of tool_choice "required" / named; special tokens kept."""
        apply_tool_grammar(self.tools, params)
        if self.keep_special_tokens:
            params.skip_special_tokens = False

    def choice(self) -> ChoiceParser:
        return ChoiceParser(self)


def _join(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    content = (a.content or "") + (b.content or "")
    reasoning = (a.reasoning_content or "") + (b.reasoning_content or "")
    calls = merge_deltas([*(a.tool_calls or ()), *(b.tool_calls or ())])
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)


class ChoiceParser:
    """One choice's reader: text pieces in, DeltaMessages out (None while nothing can be sent yet)."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.reasoning = output.reasoning_parser(output.prompt, output.constrained) if output.reasoning_parser else None
        mode, make_id = output.tools.mode, output.make_id
        self.tools: ToolParser | None = None
        if mode == "auto" and output.tool_parser is not None:
            self.tools = output.tool_parser(make_id)
        elif mode == "named":
            self.tools = NamedToolOutput(output.tools.function, make_id)
        elif mode == "required":
            self.tools = RequiredToolOutput(make_id)

    @property
    def plain(self) -> bool:
        """No reasoning or tool parser: every piece of text is content as it comes (and the finish reason stays)."""
        return self.reasoning is None and self.tools is None

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def feed(self, text: str) -> DeltaMessage | None:
        return self._step(text, final=False)

    def finish(self, text: str = "") -> DeltaMessage | None:
        """The last piece: everything held back is decided."""
        return self._step(text, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when "auto" or "required" produced calls and the choice stopped normally (a named
        function's call stays "stop", as OpenAI answers a forced function)."""
        if reason == "stop" and self.tools_called and self.output.tools.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def message(self, text: str) -> ChatResponseMessage:
        """The whole message of a finished choice (the same reading as streaming, in one piece)."""
        d = self.finish(text) or DeltaMessage()
        content, calls = assemble([d])
        if content is None and not (calls or d.reasoning_content):
            content = ""  # a plain empty answer is "", as before; beside calls or thinking it is null (vLLM)
        return ChatResponseMessage(content=content, tool_calls=calls, reasoning_content=d.reasoning_content)

    def _step(self, text: str, final: bool) -> DeltaMessage | None:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        out = DeltaMessage(reasoning_content=reasoning or None)
        if self.tools is None:
            return _join(out if reasoning else None, DeltaMessage(content=content) if content else None)
        d = self.tools.feed(content)
        if final:
            d = _join(d, self.tools.finish())
        if d is not None and d.tool_calls and not self.output.parallel_tool_calls:
            d.tool_calls = [t for t in d.tool_calls if t.index == 0] or None  # vLLM keeps the first call
        if d is not None and not d.content and not d.tool_calls:
            d = None
        return _join(out if reasoning else None, d)
