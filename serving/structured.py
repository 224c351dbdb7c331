"""Structured output with llguidance: a `response_format` (json_object / json_schema) compiled to a grammar over the
model's own `tokenizers` vocabulary, and per-sample constraints giving the allowed-token mask of the next step.

The engine has no per-request mask hook yet, so the server still answers such requests with 400; `constrained_greedy`
drives a constraint through `LLM.logits` to show the pieces work end to end. Needs `pip install llguidance`."""

from __future__ import annotations

from typing import Any

import numpy as np

from netra_jax.serving.protocol import ResponseFormat
from netra_jax.tokenizer import Tokenizer


class StructuredOutputError(ValueError):
    """The response_format cannot be compiled (bad JSON schema, unsupported keyword)."""


def grammar_for(fmt: ResponseFormat) -> str | None:
    """The llguidance grammar of a response_format; None for plain text."""
    import llguidance

    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    else:
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise StructuredOutputError("response_format json_schema needs json_schema.schema")
        schema = fmt.json_schema.json_schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    except Exception as e:  # a schema that is not even JSON-serializable
        raise StructuredOutputError(f"invalid JSON schema: {e}") from None


class StructuredOutputs:
    """Compiles grammars against one tokenizer (building the llguidance tokenizer once, ~1 s for big vocabularies)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance

        self.vocab_size = vocab_size
        eos = list(tokenizer.eos_token_ids) or None
        self.lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)

    def check(self, grammar: str) -> None:
        """Raise StructuredOutputError naming the problem (llguidance reports schema errors here, not earlier)."""
        import llguidance

        err = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if err and not err.startswith("WARNING"):
            raise StructuredOutputError(err)

    def constraint(self, grammar: str) -> TokenConstraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(matcher.get_error())
        return TokenConstraint(matcher, self.vocab_size)


class TokenConstraint:
    """One sample's grammar state: `allowed()` is the boolean mask [vocab] of the next token, `accept(token)`
    advances it (False if the token broke the grammar), `done` once the grammar has ended (EOS accepted)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


def constrained_greedy(llm, prompt_ids: list[int], constraint: TokenConstraint, max_tokens: int) -> list[int]:
    """Greedy decoding under `constraint` through `LLM.logits` (one full forward per token: a check of the
    constraint pieces, not a serving path). Stops when the grammar ends or after max_tokens."""
    out: list[int] = []
    while len(out) < max_tokens and not constraint.done:
        logits = llm.logits(prompt_ids + out)[-1]
        tok = int(np.argmax(np.where(constraint.allowed(), logits, -np.inf)))
        if not constraint.accept(tok):
            raise StructuredOutputError(f"token {tok} was allowed by the mask but rejected by the grammar")
        out.append(tok)
    return out
