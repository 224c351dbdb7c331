"""The mixture-of-experts fixtures through a real `netra-jax serve` process each: a greedy completion gives
transformers' 24 token ids, and its first log-prob is the log-softmax of the reference logits."""

from __future__ import annotations

import pytest
from support.checkpoints import FIXTURES, MOE_MODELS, reference
from support.server import log_softmax, openai_client, running_server


@pytest.mark.parametrize("name", MOE_MODELS)
def test_greedy_completion_matches_reference(name):
    flags = ("--no-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "64")
    with running_server(*flags, model=str(FIXTURES / name)) as server:
        client = openai_client(server)
        assert [m.id for m in client.models.list().data] == [name]
        case = reference(name)["cases"][0]
        r = client.completions.create(
            model=name,
            prompt=case["prompt_ids"],
            max_tokens=24,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    ch = r.choices[0]
    assert ch.token_ids == case["greedy_ids"] and ch.finish_reason == "length"
    expected = log_softmax(case["logits"][-1], case["greedy_ids"][0])
    assert abs(ch.logprobs.token_logprobs[0] - expected) < 1e-4
