"""Streaming characters split across byte tokens (logit_bias on a 2-, 3- and 4-byte character's bytes): no U+FFFD
in any delta, and the deltas concatenate to the non-streamed text."""

from __future__ import annotations

import json

import httpx
import pytest
from reliability_harness import main_server, release_main_server
from support.checkpoints import FIXTURES
from support.server import MODEL, sse_events

C = "/v1/completions"
# (prompt, character): prompts found by search for which greedy decoding starts on the character's lead byte
CASES = [([458, 93], "é"), ([469, 48, 103, 482], "䭸"), ([405, 455, 104, 258], "\U0001801f")]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(request):
    yield main_server()
    release_main_server(request)


def _byte_tokens() -> dict[int, int]:
    """byte -> token id of the fixture's byte-level BPE (GPT-2's printable byte alphabet)."""
    vocab = json.loads((FIXTURES / MODEL / "tokenizer.json").read_text())["model"]["vocab"]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return {b: vocab[c] for b, c in chars.items()}


@pytest.mark.parametrize("prompt, char", CASES, ids=["2-byte", "3-byte", "4-byte"])
def test_split_characters_stream_whole(server, prompt, char):
    raw = char.encode()
    byte_tok = _byte_tokens()
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(byte_tok[b]): 40 for b in raw},
        "frequency_penalty": 2.0,
    }
    with httpx.Client(base_url=server.url, timeout=60) as http:
        full = http.post(C, json={**body, "return_token_ids": True}).json()["choices"][0]
        assert full["token_ids"] == [byte_tok[b] for b in raw] * (MAX_TOKENS // len(raw))  # one byte per token
        assert full["text"] == char * (MAX_TOKENS // len(raw))
        for n in (1, 2):
            with http.stream("POST", C, json={**body, "n": n, "stream": True}) as r:
                events = sse_events(list(r.iter_lines()))
            assert events[-1] == "[DONE]"
            for i in range(n):
                deltas = [c["text"] for e in events[:-1] for c in e["choices"] if c["index"] == i and c["text"]]
                assert all("\ufffd" not in d for d in deltas), deltas
                assert "".join(deltas) == full["text"]
                assert len(deltas) > 1  # it did stream, character by character
