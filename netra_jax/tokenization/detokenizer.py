"""Incremental detokenization for streaming: turn each step's new token ids into newly final text.
Never emits half a UTF-8 character and decodes only a short window of recent tokens per step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from netra_jax.tokenization.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context, so the first output token decodes as in the full text
MAX_HELD_TOKENS = 16  # a tail still incomplete after this many tokens is invalid UTF-8 and is emitted as U+FFFD
_MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so a character boundary lies within 4 tokens


class IncrementalDetokenizer:
    """Per-request streaming decoder using the prefix/read-offset technique.

    The window `tokens[prefix_offset:]` is decoded each step; the text of `tokens[prefix_offset:read_offset]`
    (already emitted) is its prefix, and whatever follows it is new. While the new text ends in U+FFFD (a
    multi-byte character split across tokens) it is held back. Once emitted, the window slides forward, so
    each `push` costs O(tokens pushed + tokens held), never O(output length).

    The concatenation of everything returned by `push` and `flush` is the text the output adds to the prompt:
    `tokenizer.decode(output_ids)` for byte-level BPE; for SentencePiece vocabularies it also keeps the space of the
    first output token's `▁`, which decoding the output alone strips. `text` holds it so far (for stop strings).
    The prompt context starts at a character boundary: byte-fallback `<0xNN>` tokens decode as one group, so a
    context opening inside a character would turn the output's first bytes into U+FFFD as well.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = frozenset(tokenizer.all_special_ids)
        context = tokenizer.check_ids(prompt_ids[-PROMPT_CONTEXT_TOKENS:] if len(prompt_ids) else [])
        text = self._decode(context)
        while text.startswith(_REPLACEMENT):  # the context opens inside a character: start after it
            context = context[1:]
            text = self._decode(context)
        self._window: list[int] = context  # tokens[prefix_offset:] of the whole sequence
        self._read = len(context)  # read_offset relative to the window start (prefix_offset)
        self._prefix_text = text
        self._chunks: list[str] = []
        self._text: str | None = ""
        self.num_tokens = 0  # output tokens pushed so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def push(self, new_ids: Iterable[int]) -> str:
        """Add newly sampled token ids; return the text they complete (possibly "")."""
        new = self.tokenizer.check_ids(new_ids)  # raises before any state changes
        if not new:
            return ""
        self._window.extend(new)
        self.num_tokens += len(new)
        end = len(self._window)
        full = self._decode(self._window)
        if not full.endswith(_REPLACEMENT):
            return self._emit(full, end)
        # The last character is incomplete: emit up to the latest token boundary that ends a character.
        for k in range(end - 1, max(self._read, end - _MAX_CHAR_TOKENS), -1):
            text = self._decode(self._window[:k])
            if not text.endswith(_REPLACEMENT):
                return self._emit(text, k)
        return self._emit(full, end) if end - self._read > MAX_HELD_TOKENS else ""

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD) at the end of the request."""
        end = len(self._window)
        return self._emit(self._decode(self._window), end) if end > self._read else ""

    def _emit(self, text: str, upto: int) -> str:
        """Emit `text` (the decoded window up to token `upto`) past the prefix, then slide the window."""
        chunk = text[len(self._prefix_text) :]  # "" when the new tokens show nothing (skipped special tokens)
        start = self._read  # the new prefix starts where the last read ended
        if not chunk and self.skip_special_tokens and all(i in self._special for i in self._window[start:upto]):
            # Tokens that decode to nothing are dropped rather than made the new prefix: a window opening on them
            # would let a SentencePiece decoder strip the `▁` space of the text that follows them. A special id that
            # does show text (a plain token the model's files call special) is emitted as any other token.
            del self._window[start:upto]
            return ""
        del self._window[:start]
        self._read = upto - start
        self._prefix_text = self._decode(self._window[: self._read])
        if chunk:
            self._chunks.append(chunk)
            self._text = None
        return chunk

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._chunks = ["".join(self._chunks)]
            self._text = self._chunks[0]
        return self._text
