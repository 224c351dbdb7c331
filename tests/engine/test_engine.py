"""Engine behaviour on a tiny fixture: batched greedy equals references and solo runs, under preemption, chunked
prefill and prefix-cache hits; seeded sampling; n > 1; stop strings; no compilations after warm-up; bad input."""

from __future__ import annotations

import random

import pytest
from support.checkpoints import FIXTURES, reference
from support.compiles import compiled_jits

from netra_jax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
MODEL = FIXTURES / "tiny-llama"


def _prompts(n: int, vocab: int, seed: int = 0, model: str = "tiny-llama") -> list[list[int]]:
    """The reference prompts of `model` plus random ones of mixed lengths (3..90 tokens)."""
    rng = random.Random(seed)
    refs = [c["prompt_ids"] for c in reference(model)["cases"]]
    out = list(refs)
    while len(out) < n:
        out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(3, 90))])
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, page_size=16, warmup=True)


@pytest.fixture(scope="module")
def solo(llm):
    """Greedy output of each prompt run alone (no companions)."""
    prompts = _prompts(32, llm.model_config.vocab_size)
    return prompts, [
        llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts
    ]


def _check_idle(llm):
    pool = llm.engine.pool
    pool.check_invariant()
    assert pool.num_in_use == 0
    assert pool.num_free + pool.num_cached == pool.num_total


def test_batch_equals_references_and_solo(llm, solo):
    prompts, alone = solo
    refs = {tuple(c["prompt_ids"]): c["greedy_ids"] for c in reference("tiny-llama")["cases"]}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o, a in zip(prompts, outs, alone, strict=True):
        assert o.outputs[0].token_ids == a
        if tuple(p) in refs:
            assert a == refs[tuple(p)]
    assert sum(tuple(p) in refs for p in prompts) == 3
    _check_idle(llm)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_kv_pages=12, max_num_seqs=16, max_num_batched_tokens=128),  # tiny pool: preemption
        dict(num_kv_pages=512, max_num_seqs=8, max_num_batched_tokens=32),  # chunked prefill (prompts up to 90)
    ],
    ids=["preemption", "chunked-prefill"],
)
def test_same_outputs_under_pressure(kw, solo):
    prompts, alone = solo
    small = LLM(MODEL, dtype="float32", warmup=False, **kw)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    if "num_kv_pages" in kw and kw["num_kv_pages"] < 20:
        assert small.engine.scheduler.num_preemptions > 0
    _check_idle(small)


def test_prefix_cache_hits_give_same_outputs(llm):
    vocab = llm.model_config.vocab_size
    rng = random.Random(7)
    system = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0]
    hits_before = llm.engine.pool.prefix_hits_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.pool.prefix_hits_tokens - hits_before >= 7 * 64
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert all(o.num_cached_tokens >= 64 for o in outs)
    nocache = LLM(MODEL, dtype="float32", warmup=False, enable_prefix_caching=False, max_num_batched_tokens=128)
    ref = nocache.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    _check_idle(llm)


def test_seeded_sampling_reproducible_across_batches(llm):
    prompts = _prompts(6, llm.model_config.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=i, ignore_eos=True) for i in range(5)]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [sp, *others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    again = llm.generate({"prompt_token_ids": prompts[0]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": prompts[0]}, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_and_top_k_one(llm):
    p = {"prompt_token_ids": reference("tiny-llama")["cases"][0]["prompt_ids"]}
    out = llm.generate(p, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False)[
        0
    ]
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    tok = llm.get_tokenizer()
    for o in out.outputs:  # every sample gets its full text, last token included
        assert len(o.token_ids) == 12 and o.finish_reason == "length"
        assert o.text == tok.decode(o.token_ids)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    top1 = llm.generate(
        p, SamplingParams(max_tokens=24, temperature=0.8, top_k=1, seed=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert top1.outputs[0].token_ids == reference("tiny-llama")["cases"][0]["greedy_ids"]
    _check_idle(llm)


def test_stop_string_cut_exactly(llm):
    case = reference("tiny-llama")["cases"][0]
    tok = llm.get_tokenizer()
    full = tok.decode(case["greedy_ids"])
    stop = full[5:9]  # a stop string that may straddle token boundaries
    assert stop and stop in full
    out = llm.generate(
        {"prompt_token_ids": case["prompt_ids"]},
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    o = out.outputs[0]
    assert o.text == full[: full.index(stop)]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    inc = llm.generate(
        {"prompt_token_ids": case["prompt_ids"]},
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert inc.text == full[: full.index(stop) + len(stop)]


def test_stop_token_text_left_out_with_special_tokens_kept(llm):
    """As vLLM: the EOS / stop token that ends a choice is not part of its text, whether special tokens are skipped
    or kept (a tool parser keeps them); include_stop_str_in_output puts it back."""
    case = reference("tiny-llama")["cases"][1]
    ids, tok = case["greedy_ids"], llm.get_tokenizer()
    cut = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # the first occurrence of its token
    for skip in (True, False):
        for include in (False, True):
            sp = SamplingParams(
                max_tokens=24,
                temperature=0,
                stop_token_ids=[ids[cut]],
                skip_special_tokens=skip,
                include_stop_str_in_output=include,
            )
            o = llm.generate({"prompt_token_ids": case["prompt_ids"]}, sp, use_tqdm=False)[0].outputs[0]
            assert o.token_ids == ids[: cut + 1] and o.finish_reason == "stop" and o.stop_reason == ids[cut]
            end = cut + 1 if include else cut
            assert o.text == tok.decode(ids[:end], skip_special_tokens=skip), (skip, include)


def test_stream_deltas_concatenate(llm):
    case = reference("tiny-llama")["cases"][2]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chunks = list(llm.stream({"prompt_token_ids": case["prompt_ids"]}, sp))
    assert chunks[-1].finished
    assert "".join(c.outputs[0].delta_text for c in chunks) == chunks[-1].outputs[0].text
    assert chunks[-1].outputs[0].token_ids == case["greedy_ids"]
    m = chunks[-1].metrics
    assert m.ttft is not None and m.e2e >= m.ttft >= 0 and m.tpot is not None


def test_no_compilations_after_warmup(llm):
    with compiled_jits() as compiled:
        rng = random.Random(11)
        vocab = llm.model_config.vocab_size
        reqs, params = [], []
        for i in range(100):
            reqs.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 200))]})
            params.append(
                SamplingParams(
                    max_tokens=rng.randrange(1, 40),
                    ignore_eos=rng.random() < 0.5,
                    temperature=rng.choice([0.0, 0.7, 1.0]),
                    top_p=rng.choice([1.0, 0.9]),
                    top_k=rng.choice([0, 20]),
                    seed=i,
                    prompt_logprobs=rng.choice([None, None, None, 0, 5]),  # from the ordinary (chunked) prefill
                )
            )
        for start in range(0, 100, 25):  # waves of different batch compositions
            llm.generate(reqs[start : start + 25], params[start : start + 25], use_tqdm=False)
        # penalties with a bias of over 128 entries and logprobs: the covering sampler programs, compiled at warm-up
        bias = dict.fromkeys(range(3, 140), 0.0)
        covered = SamplingParams(max_tokens=2, repetition_penalty=1.3, logit_bias=bias, seed=1, logprobs=2)
        llm.generate(reqs[0], covered, use_tqdm=False)
        after_warm = list(compiled)
        # control: the research hook's whole-prompt logits are not a serving program, so the counter sees them compile
        llm.engine.runner.prompt_logits([5, 6, 7])
    model_steps = [n for n in after_warm if n in ("_step", "sample_tokens", "token_logprobs", "_widen_ids")]
    assert model_steps == [], f"compiled after warm-up: {model_steps}"
    assert "_all_logits" in compiled[len(after_warm) :]


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 10**6]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=0), "max_tokens"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(top_p=0.0), "top_p"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(top_p=1.5), "top_p"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=-1), "temperature"),
        ({"prompt_token_ids": [1] * 600}, SamplingParams(), "context"),
        ({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=100), "context"),
    ],
)
def test_bad_input_rejected_engine_keeps_serving(llm, prompt, params, match):
    steps = llm.engine.runner.num_steps
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert llm.engine.runner.num_steps == steps  # nothing reached the device
    assert not llm.engine.has_unfinished_requests()
    _check_idle(llm)
    case = reference("tiny-llama")["cases"][1]
    out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == case["greedy_ids"]


def test_logprobs_and_prompt_logprobs(llm):
    import numpy as np

    case = reference("tiny-llama")["cases"][0]
    ids = case["prompt_ids"]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    ref = np.asarray(case["logits"], np.float64)  # transformers' logits at every prompt position
    ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, tok in enumerate(ids[1:]):
        entry = out.prompt_logprobs[i + 1]
        assert abs(entry[tok].logprob - ref_lp[i, tok]) < 1e-4
        assert entry[tok].rank == int((ref_lp[i] > ref_lp[i, tok]).sum()) + 1
        assert len(entry) in (2, 3)
    o = out.outputs[0]
    assert len(o.logprobs) == 4
    first = o.logprobs[0]
    assert o.token_ids[0] == case["greedy_ids"][0]
    assert abs(first[o.token_ids[0]].logprob - ref_lp[-1, o.token_ids[0]]) < 1e-4
    assert first[o.token_ids[0]].rank == 1 and len(first) == 3
    assert abs(o.cumulative_logprob - sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids, strict=True))) < 1e-5


def test_more_samples_than_the_queue_cap_is_a_bad_request():
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import EngineConfig, SchedulerConfig

    engine = build_engine(
        EngineConfig(model=str(MODEL), dtype="float32", warmup=False, scheduler=SchedulerConfig(max_waiting=2))
    )
    with pytest.raises(ValueError, match="n=3 samples can never fit the waiting queue"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=3, max_tokens=2))
    engine.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_in_use == 0 and not engine.scheduler.has_unfinished()
