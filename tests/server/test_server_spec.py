"""A real `netra-jax serve --speculative-config` process: completions equal the non-speculative engine's greedy
tokens with nothing compiled on the request path, /metrics counts proposals and acceptances, and a bad
--speculative-config is one line with exit status 2."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support.checkpoints import FIXTURES, reference
from support.server import SMALL, openai_client, running_server

from netra_jax.cli import main

MODEL = "tiny-qwen3"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_speculative_server_matches_reference_and_reports_acceptance():
    cases = reference(MODEL)["cases"]
    with running_server(*SMALL, "--speculative-config", json.dumps(NGRAM), model=str(FIXTURES / MODEL)) as srv:
        client = openai_client(srv)
        compiled = _metrics(srv.url)[("netra_xla_compilations_outside_warmup", ())]
        for case in cases:
            r = client.completions.create(
                model=MODEL,
                prompt=case["prompt_ids"],
                max_tokens=len(case["greedy_ids"]),
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert r.choices[0].token_ids == case["greedy_ids"]
        repeated = (cases[0]["prompt_ids"][:6] * 8)[:40]  # a prompt whose n-grams recur: proposals are made
        client.completions.create(model=MODEL, prompt=repeated, max_tokens=24, temperature=0)
        m = _metrics(srv.url)
    assert m[("netra_xla_compilations_outside_warmup", ())] == compiled  # nothing compiled on the request path
    drafts = m[("netra_spec_decode_num_drafts", ())]
    proposed = m[("netra_spec_decode_num_draft_tokens", ())]
    accepted = m[("netra_spec_decode_num_accepted_tokens", ())]
    per_pos = [m[("netra_spec_decode_num_accepted_tokens_per_pos", (("position", str(i)),))] for i in range(3)]
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_bad_speculative_config_is_one_line(capsys):
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    assert main(["generate", "Hi", str(FIXTURES / MODEL), "--speculative-config", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--speculative-config" in err[0] and "num_speculative_tokens" in err[0]
