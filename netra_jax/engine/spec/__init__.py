"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) suggest next tokens, the target's ordinary
step verifies them (`accept`), `SpecStats` counts what was accepted, and `policy.Speculation` decides who proposes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from netra_jax.engine.spec.ngram import NgramProposer
from netra_jax.engine.spec.stats import SpecStats, accept, stats_between
from netra_jax.engine_config import SpeculativeConfig

if TYPE_CHECKING:
    from netra_jax.engine.request import Request

__all__ = [
    "NgramProposer",
    "NgramRequestProposer",
    "SpecStats",
    "accept",
    "make_proposer",
    "stats_between",
]


class NgramRequestProposer:
    """The engine's proposer interface over `NgramProposer`: one proposal per request, from its own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        return [self.ngram.propose(r.all_token_ids, k) for r, k in zip(requests, limits, strict=True)]

    def observe(self, run) -> None:
        """Nothing to mirror: proposals come from the requests' tokens."""

    def warmup(self) -> None:
        """Nothing to compile."""


def make_proposer(
    config: SpeculativeConfig, runner, scheduler, draft=None, *, max_num_batched_tokens: int, max_model_len: int
):
    """The proposer of `config.method`: n-gram lookup, or the draft model `draft` = (ModelConfig, params) sharing
    the target runner's page layout and the scheduler's block tables."""
    if config.method == "ngram":
        return NgramRequestProposer(config)
    if draft is None:
        raise ValueError("method 'draft_model' needs the draft model's (ModelConfig, params)")
    from netra_jax.engine.spec.draft import DraftProposer

    return DraftProposer(config, runner, scheduler, *draft, max_num_batched_tokens, max_model_len)
