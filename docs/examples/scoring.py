"""Scoring continuations (lm-evaluation-harness's loglikelihood): many (prompt, continuation) pairs in one call,
through the engine's batched steps, with shared prompts taken from the prefix cache
(python docs/examples/scoring.py [MODEL])."""

import sys

import numpy as np

from netra_jax import LLM

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
question = "Question: What is the capital of France?\nAnswer:"
choices = [" Paris", " London", " Berlin", " Madrid"]
scores = llm.score_continuations([question] * len(choices), choices)
for choice, s in zip(choices, scores, strict=True):
    print(f"{choice!r}: sum logprob {s.logprob:.3f}, greedy {s.is_greedy}, tokens {s.continuation_token_ids}")
print("answer:", choices[int(np.argmax([s.logprob for s in scores]))])

# checked against the per-position logits of the whole text (another program: equal to float32 rounding)
s = scores[0]
ids = s.prompt_token_ids + s.continuation_token_ids
logits = llm.logits(ids)  # [len(ids), vocab]; row i predicts token i + 1
logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
n = len(s.prompt_token_ids)
expect = [logp[n - 1 + j, t] for j, t in enumerate(s.continuation_token_ids)]
assert np.allclose(s.token_logprobs, expect, atol=1e-2)
