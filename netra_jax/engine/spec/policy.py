"""The engine's speculative decoding policy, one object: before a step, which running requests get proposals (within
their length limits, a grammar's valid prefix, none above disable_by_batch_size, back-off after failures), the
proposer that makes them, and the acceptance counters. The engine calls it; it never steps the engine itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from netra_jax.engine.spec.stats import SpecStats
from netra_jax.engine_config import SpeculativeConfig

__all__ = ["MAX_BACKOFF", "Speculation"]

MAX_BACKOFF = 4  # a request with failing proposals waits at most 2^4 - 1 steps before proposing again


class Speculation:
    """config: the speculative settings; proposer: `make_proposer`'s; max_seqs: the most sequences a step verifies
    proposals for (the runner's compiled logit rows)."""

    def __init__(self, config: SpeculativeConfig, proposer, max_seqs: int) -> None:
        self.config, self.proposer, self.max_seqs = config, proposer, max_seqs
        self.stats = SpecStats(config.num_speculative_tokens)

    def propose(self, running: Sequence, grammar_of: Callable[[object], object | None], max_model_len: int) -> None:
        """Give each decoding request (its next step computes only its last token) up to k proposed tokens
        (`request.spec_token_ids`), within its length limit; with a grammar, only the proposal's prefix the grammar
        accepts. Nothing is proposed while more than disable_by_batch_size requests run. A request whose proposals
        keep failing backs off: after m proposals in a row with nothing accepted it gets none for its next 2^m - 1
        steps (at most 15), so text that does not repeat its context costs few wasted verifications.
        grammar_of(request): the request's grammar, None without one, or `False` for a request the engine no longer
        serves (it gets no proposal)."""
        spec = self.config
        if spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size:
            return
        chosen, limits, grammars = [], [], []
        for req in running[: self.max_seqs]:
            if req.num_scheduled_end != req.num_tokens - 1 or req.num_placeholders:
                continue
            if req.spec_pause:
                req.spec_pause -= 1
                continue
            grammar = grammar_of(req)
            if grammar is False:
                continue
            room = min(req.max_total_tokens or max_model_len, max_model_len) - req.num_tokens - 1
            if room > 0:
                chosen.append(req)
                limits.append(min(room, spec.num_speculative_tokens))
                grammars.append(grammar)
        for req, grammar, proposal in zip(chosen, grammars, self.proposer.propose(chosen, limits), strict=True):
            if grammar is not None:
                proposal = proposal[: grammar.valid_prefix(proposal)]
            req.spec_token_ids = proposal

    def record(self, req, num_drafted: int, num_accepted: int) -> None:
        """Count a verification and set the request's back-off."""
        self.stats.record(num_drafted, num_accepted)
        req.spec_misses = 0 if num_accepted else min(req.spec_misses + 1, MAX_BACKOFF)
        req.spec_pause = (1 << req.spec_misses) - 1
