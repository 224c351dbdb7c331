"""Speculative-decoding acceptance read from a server's Prometheus /metrics: vLLM's counter names under any of the
prefixes netra-jax (netra_), vLLM (vllm:) and llama-server (llamacpp:, with --metrics) use; summed per pass."""

from __future__ import annotations

import re

import httpx

PREFIXES = ("netra_", "vllm:", "llamacpp:")
COUNTERS = {  # vLLM's names, without prefix and _total suffix -> our keys (those of LLMEngine.spec_stats)
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def _base_name(name: str) -> str | None:
    for p in PREFIXES:
        if name.startswith(p):
            name = name[len(p) :]
            return name[: -len("_total")] if name.endswith("_total") else name
    return None


def parse(text: str) -> dict | None:
    """{"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]} summed over label sets,
    or None when the text has no speculative counters (speculation off, or a server that does not count it)."""
    counts: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        base = _base_name(m.group(1))
        if base is None or base.endswith(("_created", "_bucket", "_count", "_sum")):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if base in COUNTERS:
            counts[COUNTERS[base]] = counts.get(COUNTERS[base], 0.0) + value
        elif base == PER_POS and (pos := _POSITION.search(m.group(2) or "")):
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    if not counts:
        return None
    out = {k: int(counts.get(k, 0)) for k in COUNTERS.values()}
    out["accepted_per_pos"] = [int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def delta(after: dict | None, before: dict | None) -> dict | None:
    """Counts of `after` minus `before` (None before: all of `after`), with the acceptance summary."""
    if after is None:
        return None
    before = before or {}
    out = {k: after[k] - before.get(k, 0) for k in COUNTERS.values()}
    prev = before.get("accepted_per_pos", [])
    out["accepted_per_pos"] = [v - (prev[i] if i < len(prev) else 0) for i, v in enumerate(after["accepted_per_pos"])]
    return summarize(out)


def summarize(c: dict) -> dict:
    """vLLM's summary: acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the
    tokens a verification step yields, its bonus token included); per position: accepted there / drafts."""
    drafts, tokens, acc = c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]
    return c | {
        "acceptance_rate": acc / tokens if tokens else None,
        "mean_acceptance_length": 1.0 + acc / drafts if drafts else None,
        "acceptance_per_pos": [a / drafts for a in c["accepted_per_pos"]] if drafts else [],
    }


async def read(client: httpx.AsyncClient, base: str, headers: dict | None = None) -> dict | None:
    """The server's speculative counters now, or None (no /metrics, or none of these counters in it)."""
    try:
        r = await client.get(base + "/metrics", headers=headers or {})
    except httpx.HTTPError:
        return None
    return parse(r.text) if r.status_code == 200 else None
