"""Mixture-of-experts fixtures through the batch engine: 32 mixed prompts batched give the tokens and log-probs of
their solo runs (and transformers' greedy ids for the reference prompts), and new routings compile nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.checkpoints import FIXTURES, MOE_MODELS, reference
from test_engine import _prompts

from netra_jax import LLM, SamplingParams

# greedy, with the top-2 log-probs of every prompt position and every generated token
TRACED = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="module", params=MOE_MODELS)
def moe(request):
    llm = LLM(FIXTURES / request.param, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, warmup=False)
    return request.param, llm


def _logprobs(out) -> np.ndarray:
    """Every log-prob the request returned (prompt positions, then generated tokens), in a fixed order."""
    rows = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    return np.array([d[t].logprob for d in rows for t in sorted(d)])


def test_batch_equals_solo_and_references(moe):
    name, llm = moe
    prompts = _prompts(32, llm.model_config.vocab_size, model=name)
    solo = [llm.generate({"prompt_token_ids": p}, TRACED, use_tqdm=False)[0] for p in prompts]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], TRACED, use_tqdm=False)
    refs = {tuple(c["prompt_ids"]): c["greedy_ids"] for c in reference(name)["cases"]}
    for p, b, s in zip(prompts, batch, solo, strict=True):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        # equal up to float32 rounding: other batch sizes pad to other shapes, whose XLA kernels may sum in another
        # order (measured: at most 1.4e-6 here, the same as for the dense fixtures); same shapes give equal bits
        np.testing.assert_allclose(_logprobs(b), _logprobs(s), rtol=0, atol=1e-5)
        if tuple(p) in refs:
            assert b.outputs[0].token_ids == refs[tuple(p)]
    assert sum(tuple(p) in refs for p in prompts) == 3


def test_new_routings_compile_nothing(moe):
    """The same batch shapes with other tokens (so other experts get the rows) reuse the compiled steps."""
    name, llm = moe
    vocab = llm.model_config.vocab_size
    rng = random.Random(5)
    lengths = [rng.randrange(3, 60) for _ in range(12)]
    first, second = ([[rng.randrange(3, vocab) for _ in range(n)] for n in lengths] for _ in range(2))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    step = llm.engine.runner._jit  # this engine's jitted step: one cache entry per compiled variant
    llm.generate([{"prompt_token_ids": p} for p in first], greedy, use_tqdm=False)
    compiled = step._cache_size()
    llm.generate([{"prompt_token_ids": p} for p in second], greedy, use_tqdm=False)
    assert compiled > 0 and step._cache_size() == compiled
