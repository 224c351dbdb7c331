"""Engine outputs in OpenAI's shapes: choices, usage, and logprobs in both formats (completions: tokens /
token_logprobs / top_logprobs / text_offset; chat: content entries with bytes and top_logprobs)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from netra_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from netra_jax.serving.protocol import (
    ChatLogprobEntry,
    CompletionLogprobs,
    PromptLogprob,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from netra_jax.tokenization.detokenizer import IncrementalDetokenizer
from netra_jax.tokenization.tokenizer import Tokenizer


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character byte-level BPE uses for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Per-token text and exact bytes (a token may hold part of a multi-byte character) for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.added = set(tokenizer.backend.get_added_tokens_decoder())
        self.byte_level = "ByteLevel" in type(tokenizer.backend.decoder).__name__ or "ByteLevel" in repr(
            tokenizer.backend.decoder
        )
        self._bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)

    def _token_bytes(self, tid: int) -> tuple[int, ...]:
        piece = self.tok.backend.id_to_token(tid)
        if piece is None:
            return ()
        if tid not in self.added:
            if self.byte_level:
                dec = _byte_decoder()
                if all(c in dec for c in piece):
                    return tuple(dec[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
                try:
                    return (int(piece[3:5], 16),)
                except ValueError:
                    pass
            piece = self.tok.decode([tid], skip_special_tokens=False)
        return tuple(piece.encode("utf-8"))

    def bytes(self, tid: int) -> list[int]:
        return list(self._bytes(tid))

    def text(self, tid: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tok.decode([tid], skip_special_tokens=False)


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
    return ranked[:k]


def _append_token(out: CompletionLogprobs, tid: int, entry: dict[int, Logprob], tt: TokenText, k: int) -> str:
    """Append token `tid` (its entry: its own logprob and the top k) to completions logprobs; returns its text."""
    lp = entry[tid]
    text = tt.text(tid, lp)
    out.tokens.append(text)
    out.token_logprobs.append(lp.logprob)
    top: dict[str, float] = {}
    for t, x in _ranked(entry, k):  # tokens showing the same text (e.g. U+FFFD): the most likely one's logprob
        top.setdefault(tt.text(t, x), x.logprob)
    top.setdefault(text, lp.logprob)
    out.top_logprobs.append(top)
    return text


def completion_logprobs(
    entries: Sequence[dict[int, Logprob]], tt: TokenText, k: int, start_offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = start_offset
    for entry in entries:
        tid = next(iter(entry))  # the sampled token comes first
        out.text_offset.append(offset)
        offset += len(_append_token(out, tid, entry, tt, k))
    return out


def prompt_text_offsets(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> list[int]:
    """Where each token's text starts in `tokenizer.decode(ids)`: the text decoded before it, one token at a time
    (O(len(ids))). A character split over tokens starts at the token that opens it; a token that shows no text
    (a skipped special token) sits where the next text starts."""
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens)
    offsets, end = [], 0
    for tid in ids:
        offsets.append(end)
        end += len(detok.push([tid]))
    return offsets


def echo_logprobs(
    ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None] | None,
    tt: TokenText,
    k: int,
    skip_special_tokens: bool = True,
) -> CompletionLogprobs:
    """Completions logprobs of an echoed prompt (vLLM's echo with logprobs): the first token has none (its
    token_logprobs and top_logprobs entries are None, as OpenAI's), every later one its own logprob and the top k
    alternatives; text_offset: where each token starts in the prompt's text."""
    if entries is None or len(entries) != len(ids):
        raise ValueError("the prompt's logprobs were not computed for every prompt token")
    out = CompletionLogprobs(text_offset=prompt_text_offsets(tt.tok, ids, skip_special_tokens))
    for tid, entry in zip(ids, entries, strict=True):
        if entry is None:
            out.tokens.append(tt.text(tid))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            _append_token(out, tid, entry, tt, k)
    return out


def join_logprobs(*parts: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Completions logprobs one after the other (an echoed prompt's, then the generated tokens'); None if none."""
    given = [p for p in parts if p is not None]
    if not given:
        return None
    return CompletionLogprobs(
        tokens=[t for p in given for t in p.tokens],
        token_logprobs=[x for p in given for x in p.token_logprobs],
        top_logprobs=[x for p in given for x in p.top_logprobs],
        text_offset=[x for p in given for x in p.text_offset],
    )


def chat_logprobs(entries: Sequence[dict[int, Logprob]], tt: TokenText, k: int) -> list[ChatLogprobEntry]:
    out = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        top = [TopLogprob(token=tt.text(t, x), logprob=x.logprob, bytes=tt.bytes(t)) for t, x in _ranked(entry, k)]
        out.append(ChatLogprobEntry(token=tt.text(tid, lp), logprob=lp.logprob, bytes=tt.bytes(tid), top_logprobs=top))
    return out


def finish(o: CompletionOutput) -> tuple[str | None, int | str | None]:
    if o.finish_reason is None:
        return None, None
    reason = o.finish_reason if o.finish_reason in ("stop", "length") else "abort"
    return reason, o.stop_reason


def usage(outs: Sequence[RequestOutput | None]) -> UsageInfo:
    """Token counts over every prompt of a request (each prompt counted once, every sample's tokens)."""
    outs = [o for o in outs if o is not None]
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return UsageInfo(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=p + c,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def prompt_logprobs(
    entries: Sequence[dict[int, Logprob] | None] | None, tt: TokenText
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: logprob, rank, decoded_token}
    holding the prompt's own token and the requested alternatives."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=tt.text(t, lp))
            for t, lp in entry.items()
        }
        for entry in entries
    ]
