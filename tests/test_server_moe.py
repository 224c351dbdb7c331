"""The mixture-of-experts fixtures through a real `netra-jax serve` process each: a greedy completion gives
transformers' 24 token ids, and its first log-prob is the log-softmax of the reference logits."""

from __future__ import annotations

import openai
import pytest
from conftest import FIXTURES, MOE_MODELS, reference
from test_server import _log_softmax, start_server


@pytest.mark.parametrize("name", MOE_MODELS)
def test_greedy_completion_matches_reference(name):
    server = start_server(
        "--no-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", model=str(FIXTURES / name)
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
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
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]
    ch = r.choices[0]
    assert ch.token_ids == case["greedy_ids"] and ch.finish_reason == "length"
    expected = _log_softmax(case["logits"][-1], case["greedy_ids"][0])
    assert abs(ch.logprobs.token_logprobs[0] - expected) < 1e-4
