"""Host-side work lists of a step (numpy, no tracing): which tokens the jnp reference takes one by one and which it
takes in query blocks of one sequence's consecutive tokens."""

from __future__ import annotations

import numpy as np

QUERY_BLOCK = 32  # tokens of one sequence that share each gathered key chunk in the reference's block path


def num_items(num_tokens: int, num_seqs: int) -> int:
    """Static bound on the query blocks of a step: each sequence's run splits into ceil(len / QUERY_BLOCK)."""
    return -(-num_tokens // QUERY_BLOCK) + num_seqs


def build_work(q_lens, num_tokens: int, num_seqs: int, per_token=None) -> tuple[np.ndarray, ...]:
    """Numpy work lists for `AttentionWork` from the real sequences' query lengths (in batch order): single-token
    sequences go to the per-token path, longer runs are cut into query blocks. `per_token[s]` True sends every token
    of sequence s to the per-token path (speculative verification: each token then gets exactly the arithmetic it
    gets when decoded alone)."""
    n_items = num_items(num_tokens, num_seqs)
    tokens = np.full(num_tokens, num_tokens, np.int32)
    start = np.zeros(n_items, np.int32)
    length = np.zeros(n_items, np.int32)
    seq = np.zeros(n_items, np.int32)
    t = nt = ni = 0
    for s, n in enumerate(q_lens):
        if n == 1 or (per_token is not None and per_token[s]):
            tokens[nt : nt + n] = np.arange(t, t + n)
            nt += n
        else:
            for o in range(0, n, QUERY_BLOCK):
                start[ni], length[ni], seq[ni] = t + o, min(QUERY_BLOCK, n - o), s
                ni += 1
        t += n
    return tokens, np.int32(nt), start, length, seq, np.int32(ni)
