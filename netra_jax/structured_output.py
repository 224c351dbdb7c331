"""Structured output with llguidance: a request's StructuredOutputsParams compiled to a grammar over the model's own
`tokenizers` vocabulary, and one matcher per sample giving each step's allowed tokens as a packed bitmask."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from netra_jax.sampling_params import StructuredOutputsParams
from netra_jax.tokenization.tokenizer import Tokenizer

# compact JSON: with flexible whitespace a weak model can emit blanks between tokens until max_tokens
_JSON_OPTIONS = {"whitespace_flexible": False}

# where a JSON schema holds subschemas: as a name -> schema map, a list, or one schema (or a list of them)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains")


class StructuredOutputError(ValueError):
    """The structured output spec cannot be compiled (bad JSON schema, regex or grammar)."""


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a (validated) spec."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if spec.json_object:
            return m.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return m.grammar_from_json_schema(closed_objects(schema), overrides=_JSON_OPTIONS)
        if spec.regex is not None:
            return m.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        # Lark, or the GBNF / EBNF (`root ::= ...`) that vLLM's examples use, converted to Lark
        return llguidance.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError) as e:  # e.g. a schema that is not JSON-serializable
        raise StructuredOutputError(f"invalid structured output spec: {e}") from None


def closed_objects(schema):
    """A copy of the schema in which every object that lists its `properties` (or `patternProperties`) and says
    nothing of others takes no others (`additionalProperties: false`), as vLLM's default backend (xgrammar's
    strict mode) reads a schema: left open, a weak model fills objects and tool arguments with made-up keys.
    An explicit `additionalProperties` or `unevaluatedProperties` is kept, and the parts of an `allOf` stay
    open (closing each would refuse the properties the others add)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONE):
        if key in out:
            out[key] = closed_objects(out[key])
    lists_properties = "properties" in out or "patternProperties" in out
    if lists_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_error(spec: StructuredOutputsParams) -> str | None:
    """Why the spec's grammar cannot be compiled (llguidance's check, no tokenizer needed), or None: a request can
    be refused naming its field before the engine admits it."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(grammar_for(spec)) or None
    except StructuredOutputError as e:
        return str(e)


class StructuredOutputs:
    """Compiles specs against one tokenizer. The llguidance tokenizer is built on first use (about 1 s for a 50k
    vocabulary). `vocab_size` is the model's: ids the tokenizer does not know (padding rows) are never allowed.
    EOS: the tokenizer's ids, else `fallback_eos_ids` (the model's), as the engine's stopping rule has it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, fallback_eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids or fallback_eos_ids)
        self._lltok = None

    @property
    def lltok(self):
        if self._lltok is None:
            import llguidance

            n = max(self.vocab_size, self.tokenizer.backend.get_vocab_size(with_added_tokens=True))
            self._lltok = llguidance.LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=n, eos_token=self.eos_token_ids or None
            )
        return self._lltok

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the output; StructuredOutputError names what is wrong with the spec."""
        import llguidance

        m = llguidance.LLMatcher(self.lltok, grammar_for(spec), log_level=0)
        if m.is_error():
            raise StructuredOutputError(f"invalid structured output spec: {m.get_error()}")
        return GrammarMatcher(m, self.vocab_size)


class GrammarMatcher:
    """One sample's grammar state. `mask()` is the packed bitmask of the next token's allowed ids (int32 words, bit j of
    word i = token 32 i + j, llguidance's layout), `accept(token)` advances it (False if the token broke the grammar),
    `done` once nothing but EOS may follow (or the matcher failed: then `error` says why)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def mask(self) -> np.ndarray:
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The mask as booleans [vocab_size] (for checks and debugging)."""
        return np.unpackbits(self.mask().view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar would accept from here (the state is unchanged)."""
        return int(self.matcher.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    def masks_along(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """The masks of the next token after each prefix of `tokens` (len(tokens) + 1 of them, fewer if a token
        breaks the grammar), for verifying proposed tokens; the state is rolled back to where it was."""
        out, n = [self.mask()], 0
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                break
            n += 1
            out.append(self.mask())
        if n:
            self.matcher.rollback(n)
        return out

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self.matcher.deep_copy(), self.vocab_size)
