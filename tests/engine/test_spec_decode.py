"""Speculative decoding on a tiny fixture: outputs equal decoding without it (greedy, seeded, logprobs, stop
strings, penalties, preemption, prefix hits, structured output), sampled tokens follow the target distribution,
a draft model equal to the target accepts everything, n-gram lookup and acceptance rules, settings, no compiles."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.compiles import compiled_jits

from netra_jax import LLM, SamplingParams
from netra_jax.config import ConfigError
from netra_jax.engine.spec import NgramProposer, accept, stats_between
from netra_jax.engine_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig, speculative_config_from
from netra_jax.sampling_params import StructuredOutputsParams

MODEL = FIXTURES / "tiny-llama"
# proposals at every batch size (the default stops them above DEFAULT_DISABLE_BY_BATCH_SIZE running requests), so
# the exactness tests verify wide batches of proposals
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,
}
ENGINE = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, warmup=False)


def _prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    """The reference prompts plus repetitive ones (a pattern repeated), whose n-grams recur so proposals are made."""
    rng = random.Random(seed)
    out = [c["prompt_ids"] for c in reference("tiny-llama")["cases"]]
    while len(out) < n:
        seg = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 10))]
        out.append((seg * 12)[: rng.randrange(8, 70)])
    return out


@pytest.fixture(scope="module")
def base():
    return LLM(MODEL, **ENGINE)


@pytest.fixture(scope="module")
def spec():
    return LLM(MODEL, speculative_config=NGRAM, **ENGINE)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check_idle(llm):
    pool = llm.engine.pool
    pool.check_invariant()
    assert pool.num_in_use == 0


def _same(a, b, logprobs: bool = False):
    for x, y in zip(a, b, strict=True):
        for o, p in zip(x.outputs, y.outputs, strict=True):
            assert o.token_ids == p.token_ids
            assert (o.text, o.finish_reason, o.stop_reason) == (p.text, p.finish_reason, p.stop_reason)
            assert (o.logprobs is None) == (p.logprobs is None)
            if logprobs and o.logprobs is not None:
                assert len(o.logprobs) == len(p.logprobs)
                for e, f in zip(o.logprobs, p.logprobs, strict=True):
                    assert e.keys() == f.keys()
                    for t in e:
                        assert e[t].rank == f[t].rank and math.isclose(e[t].logprob, f[t].logprob, abs_tol=1e-5)


def _accepted(llm, before) -> int:
    return stats_between(before, llm.engine.spec_stats())["num_accepted_tokens"]


def test_greedy_equals_no_speculation(base, spec):
    prompts = _prompts(base.model_config.vocab_size)
    before = spec.engine.spec_stats()
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3) for _ in prompts]
    params[1] = SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, presence_penalty=0.5)
    params[2] = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)  # length ends mid-proposal
    params[3] = SamplingParams(max_tokens=30, temperature=0, min_tokens=20, logit_bias={5: 2.0})
    _same(_run(base, prompts, params), _run(spec, prompts, params), logprobs=True)
    assert _accepted(spec, before) > 20  # the proposals were used
    refs = reference("tiny-llama")["cases"]
    outs = _run(spec, [c["prompt_ids"] for c in refs], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"][:24] for c in refs]
    _check_idle(spec)


def test_stop_strings_and_tokens_inside_accepted_runs(base, spec):
    """A stop that falls inside a step's accepted tokens ends the output there, as without speculation."""
    prompts = _prompts(base.model_config.vocab_size, n=8, seed=1)
    full = _run(base, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    tok = base.get_tokenizer()
    before = spec.engine.spec_stats()
    for p, f in zip(prompts, full, strict=True):
        ids = f.outputs[0].token_ids
        text = tok.decode(ids)
        cases = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[ids[len(ids) // 2]])]
        if len(text) > 12:
            cases.append(SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[text[8:11]]))
        for sp in cases:
            _same(_run(base, [p], sp), _run(spec, [p], sp))
    assert _accepted(spec, before) > 0
    _check_idle(spec)


def test_seeded_sampling_equals_no_speculation(base, spec):
    prompts = _prompts(base.model_config.vocab_size, n=8, seed=2)
    params = [
        SamplingParams(max_tokens=32, temperature=0.3, top_k=3, seed=i, ignore_eos=True, logprobs=2, n=1 + i % 2)
        for i in range(len(prompts))
    ]
    before = spec.engine.spec_stats()
    _same(_run(base, prompts, params), _run(spec, prompts, params), logprobs=True)
    assert _accepted(spec, before) > 10
    _check_idle(spec)


@pytest.fixture(scope="module")
def self_draft():
    """The target as its own draft model: its proposals are the target's greedy tokens (at every batch size)."""
    spec = {"model": str(MODEL), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    return LLM(MODEL, speculative_config=spec, **ENGINE)


def test_sampled_tokens_follow_the_target_distribution(self_draft):
    """The token after a fixed first token, sampled with speculation over 600 seeds, against the target's own
    distribution (temperature 1 over the top 2 tokens, from the model's logits): chi-square, fixed seeds. The
    proposals are the target's greedy tokens, accepted with the target's probability of them (about half)."""
    llm = self_draft
    prompt = reference("tiny-llama")["cases"][0]["prompt_ids"]
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=s, ignore_eos=True) for s in range(600)]
    before = llm.engine.spec_stats()
    outs = [o.outputs[0].token_ids for o in _run(llm, [prompt] * len(sp), sp)]
    assert _accepted(llm, before) > 100
    first, _ = Counter(o[0] for o in outs).most_common(1)[0]
    seconds = Counter(o[1] for o in outs if o[0] == first)
    logits = llm.logits(prompt + [first])[-1]
    top = np.argsort(-logits)[:2]
    p = np.exp(logits[top] - logits[top].max())
    p /= p.sum()
    n = sum(seconds.values())
    assert set(seconds) <= set(top.tolist())
    chi2 = sum((seconds.get(int(t), 0) - n * q) ** 2 / (n * q) for t, q in zip(top, p, strict=True))
    assert n > 100 and chi2 < 10.83, (chi2, seconds, p)  # 1 degree of freedom, p = 0.001


@pytest.mark.parametrize(
    "kw",
    [dict(num_kv_pages=14), dict(max_num_batched_tokens=32)],
    ids=["preemption", "chunked-prefill"],
)
def test_greedy_equal_under_pressure(kw, base):
    prompts = _prompts(base.model_config.vocab_size, n=16, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    small = LLM(MODEL, speculative_config=NGRAM, **{**ENGINE, **kw})
    _same(_run(base, prompts, params), _run(small, prompts, params))
    if "num_kv_pages" in kw:
        assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.spec_stats()["num_accepted_tokens"] > 0
    _check_idle(small)


def test_prefix_hits_and_structured_output(base, spec):
    vocab = base.model_config.vocab_size
    rng = random.Random(4)
    system = [rng.randrange(3, vocab) for _ in range(40)] * 2
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    _run(spec, prompts[:1], greedy)
    hits = spec.engine.pool.prefix_hits_tokens
    _same(_run(base, prompts, greedy), _run(spec, prompts, greedy))
    assert spec.engine.pool.prefix_hits_tokens - hits >= 5 * 64
    choice = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma"])
    )
    _same(_run(base, prompts[:3], choice), _run(spec, prompts[:3], choice))
    _check_idle(spec)


def test_grammar_requests_verify_proposals_the_grammar_allows(base, spec):
    """Proposals are cut to the grammar's valid prefix and each verified position gets the mask of the state
    after the proposals before it: outputs equal decoding without speculation."""
    tok = base.get_tokenizer()
    texts = ["the cat sat on the mat and the cat sat on the mat and the cat", "ab ab ab ab ab ab ab ab ab ab ab"]
    prompts = [tok.encode(t) for t in texts]
    regex = SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,80}")
    )
    before = spec.engine.spec_stats()
    _same(_run(base, prompts, regex), _run(spec, prompts, regex))
    stats = stats_between(before, spec.engine.spec_stats())
    assert stats["num_accepted_tokens"] > 0, stats
    _check_idle(spec)


def test_draft_model_equal_to_target_accepts_everything(base, self_draft):
    """The target as its own draft proposes exactly its greedy tokens: every greedy proposal is accepted."""
    prompts = _prompts(base.model_config.vocab_size, n=6, seed=6)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    before = self_draft.engine.spec_stats()
    _same(_run(base, prompts, params), _run(self_draft, prompts, params))
    stats = stats_between(before, self_draft.engine.spec_stats())
    assert stats["num_draft_tokens"] > 50 and stats["acceptance_rate"] == 1.0
    assert stats["mean_acceptance_length"] > 3.0
    _check_idle(self_draft)


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, smollm2_path):
    with pytest.raises(ValueError, match="same tokenizer"):  # another vocabulary size
        LLM(MODEL, speculative_config={"model": str(smollm2_path), "num_speculative_tokens": 2}, **ENGINE)
    other = tmp_path / "draft"
    shutil.copytree(MODEL, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="differs from the target's at id 100"):
        LLM(MODEL, speculative_config={"model": str(other), "num_speculative_tokens": 2}, **ENGINE)


def test_ngram_proposer_matches_brute_force():
    rng = np.random.default_rng(0)

    def brute(tokens, k, lo, hi):
        L = len(tokens)
        for n in range(min(hi, L - 1), lo - 1, -1):
            suffix = tokens[L - n :]
            starts = [i for i in range(L - n) if tokens[i : i + n] == suffix]
            if starts:
                return tokens[starts[-1] + n : starts[-1] + n + k]
        return []

    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        assert NgramProposer(k, lo, hi).propose(tokens) == brute(tokens, k, lo, hi), (tokens, k, lo, hi)
    assert NgramProposer(3, 2, 2).propose([1, 2, 3, 9, 1, 2]) == [3, 9, 1]
    assert NgramProposer(3, 2, 2).propose([1, 2, 3, 4]) == []


def test_accept_rule():
    assert accept([], [7]) == [7]
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch is the target's own token
    assert accept([5, 6], [4, 6, 1]) == [4]
    with pytest.raises(ValueError, match="sampled tokens"):
        accept([1, 2], [1, 2])


def test_speculative_config_like_vllm():
    c = speculative_config_from('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert speculative_config_from({"num_speculative_tokens": 2}).prompt_lookup_max == 5
    # disable_by_batch_size: omitted, the measured default; null, always speculate (vLLM's default)
    assert speculative_config_from({"num_speculative_tokens": 2}).disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert (
        speculative_config_from('{"num_speculative_tokens": 2, "disable_by_batch_size": null}').disable_by_batch_size
        is None
    )
    d = speculative_config_from({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (d.method, d.model) == ("draft_model", "/some/draft")
    assert speculative_config_from(None) is None and speculative_config_from(c) is c
    for bad, match in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, r"\[1, 16\]"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(ConfigError, match=match):
            speculative_config_from(bad)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=0)


def test_disable_by_batch_size_stops_proposals(base):
    llm = LLM(MODEL, speculative_config={**NGRAM, "disable_by_batch_size": 2}, **ENGINE)
    prompts = _prompts(base.model_config.vocab_size, n=8, seed=7)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    _same(_run(base, prompts, params), _run(llm, prompts, params))  # 8 at once: no proposals until 2 are left
    batch = llm.engine.spec_stats()["num_drafts"]
    _run(llm, prompts[3:4], params)
    assert llm.engine.spec_stats()["num_drafts"] - batch > 0  # alone, it speculates


def test_no_compilations_after_warmup_with_speculation():
    llm = LLM(MODEL, speculative_config=NGRAM, **{**ENGINE, "warmup": True, "max_num_seqs": 8})
    with compiled_jits() as compiled:
        rng = random.Random(8)
        prompts = _prompts(llm.model_config.vocab_size, n=30, seed=8)
        params = [
            SamplingParams(
                max_tokens=rng.randrange(1, 30),
                temperature=rng.choice([0.0, 0.7]),
                seed=i,
                ignore_eos=True,
                logprobs=rng.choice([None, 2]),
            )
            for i in range(len(prompts))
        ]
        _run(llm, prompts, params)
    assert llm.engine.spec_stats()["num_accepted_tokens"] > 0
    assert [n for n in compiled if n in ("_step", "sample_tokens", "token_logprobs", "_widen_ids")] == []
