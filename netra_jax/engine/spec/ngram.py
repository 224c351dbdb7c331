"""N-gram prompt lookup (vLLM's "ngram" method): propose the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens. Host-only numpy, no model: cheap enough to run for every request every step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposals from a request's own tokens (prompt + output). The longest suffix length n in [min_n, max_n] that
    occurs earlier wins; among its occurrences the most recent one with a continuation is used."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to k (default: num_speculative_tokens) proposed next tokens; [] when no n-gram matches."""
        k = self.k if k is None else min(k, self.k)
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        L = tokens.shape[0]
        if k <= 0 or L < self.min_n + 1:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n :]  # [n]
            # candidate starts i in [0, L - n - 1]: tokens[i:i + n] == suffix and at least one token follows
            hit = tokens[: L - n] == suffix[0]  # [L - n]
            for j in range(1, n):
                hit &= tokens[j : L - n + j] == suffix[j]
            where = np.flatnonzero(hit)
            if where.size:
                start = int(where[-1]) + n
                return tokens[start : start + k].tolist()
        return []
