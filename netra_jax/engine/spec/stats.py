"""Verification of proposed tokens against the target's samples, and the acceptance counters reported in
`/metrics`, the offline summary and benchmark results (vLLM's spec-decode counters)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verification step emits. sampled[j] is the target's token at the position after drafts[:j]
    (len(sampled) == len(drafts) + 1, each drawn exactly as a lone decode step would draw it). A draft is accepted
    while it equals the target's token at its position; the first mismatch (or the bonus after the last draft) is
    the target's own token. With a one-hot proposal this is exact rejection sampling: a draft survives with the
    target's probability of it, and a rejected position carries the target's draw, conditioned on differing."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    out = [int(sampled[0])]
    for j, d in enumerate(drafts):
        if int(d) != out[-1]:
            break
        out.append(int(sampled[j + 1]))
    return out


@dataclass
class SpecStats:
    """Counters since start: drafts (verification steps with at least one proposed token), proposed and accepted
    tokens, and acceptances per draft position (position 0 = the first proposed token)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 (the target's own) + accepted drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def stats_between(before: dict | None, after: dict) -> dict:
    """The counters of `after` minus those of `before` (both `SpecStats.as_dict()`, before None: since start), with
    the rates recomputed: the figures of a run on an engine that served other work earlier."""
    k = len(after["accepted_per_pos"])
    s = SpecStats(k)
    b = before or SpecStats(k).as_dict()
    s.num_drafts = after["num_drafts"] - b["num_drafts"]
    s.num_draft_tokens = after["num_draft_tokens"] - b["num_draft_tokens"]
    s.num_accepted_tokens = after["num_accepted_tokens"] - b["num_accepted_tokens"]
    s.accepted_per_pos = [x - y for x, y in zip(after["accepted_per_pos"], b["accepted_per_pos"], strict=True)]
    return s.as_dict()
