"""Overlapped (async) scheduling gives exactly the outputs of the synchronous loop: greedy, seeded sampling with
penalties, stop strings, n > 1, preemption, structured output, prompt logprobs; aborts leak no blocks; and steps
really overlap (later steps take their input tokens from the previous step's sampled ids on device)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, SamplingParams
from netra_jax.sampling_params import StructuredOutputsParams

MODEL = FIXTURES / "tiny-llama"
KW = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, page_size=16, warmup=False)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    refs = [c["prompt_ids"] for c in reference("tiny-llama")["cases"]]
    out = list(refs)
    while len(out) < n:
        out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(2, 90))])
    return [{"prompt_token_ids": p} for p in out]


@pytest.fixture(scope="module")
def pair():
    """The same engine twice: synchronous and overlapped."""
    return LLM(MODEL, async_scheduling=False, **KW), LLM(MODEL, async_scheduling=True, **KW)


def _check_idle(llm):
    llm.engine.pool.check_invariant()
    llm.engine.scheduler.check_invariant()
    assert llm.engine.pool.num_in_use == 0 and not llm.engine.scheduler.has_unfinished()
    assert not llm.engine.has_unfinished_requests() and llm.engine._in_flight is None  # no step outlives the call


def _summary(outs):
    """Tokens, text and finish of every sample (logprobs agree to float noise: the batches differ)."""
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in outs]


def _logprobs_close(a, b):
    for ra, rb in zip(a, b, strict=True):
        for oa, ob in zip(ra.outputs, rb.outputs, strict=True):
            assert (oa.logprobs is None) == (ob.logprobs is None)
            for da, db in zip(oa.logprobs or [], ob.logprobs or [], strict=True):
                assert da.keys() == db.keys()
                np.testing.assert_allclose(
                    [v.logprob for v in da.values()], [v.logprob for v in db.values()], atol=1e-5
                )


def _both(pair, prompts, params):
    sync, overlap = (llm.generate(prompts, params, use_tqdm=False) for llm in pair)
    for llm in pair:
        _check_idle(llm)
    return sync, overlap


def test_overlap_really_overlaps(pair, monkeypatch):
    """Decode steps of the overlapped engine are dispatched before the previous step's tokens reach the host."""
    runner = pair[1].engine.runner
    seen = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda out, *prev: seen.append(bool(prev)) or run(out, *prev))
    p = _prompts(3, pair[1].model_config.vocab_size)[0]
    out = pair[1].generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference("tiny-llama")["cases"][0]["greedy_ids"][:12]
    assert all(seen[1:]) and len(seen) >= 11  # every decode step


def test_greedy_and_seeded_sampling_identical(pair):
    vocab = pair[0].model_config.vocab_size
    prompts = _prompts(16, vocab)
    rng = random.Random(1)
    params = []
    for i in range(len(prompts)):
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(3, 30),
                temperature=rng.choice([0.0, 0.8, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 20]),
                min_tokens=rng.choice([0, 3]),
                repetition_penalty=rng.choice([1.0, 1.2]),
                frequency_penalty=rng.choice([0.0, 0.5]),
                logprobs=rng.choice([None, 2]),
                ignore_eos=rng.random() < 0.5,
                seed=i,
            )
        )
    sync, overlap = _both(pair, prompts, params)
    assert _summary(sync) == _summary(overlap)
    _logprobs_close(sync, overlap)
    refs = {tuple(c["prompt_ids"]): c["greedy_ids"] for c in reference("tiny-llama")["cases"]}
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for r in pair[1].generate(prompts[:3], greedy, use_tqdm=False):
        assert r.outputs[0].token_ids == refs[tuple(r.prompt_token_ids)]


def test_stop_strings_and_n_samples_identical(pair):
    case = reference("tiny-llama")["cases"][0]
    full = pair[0].get_tokenizer().decode(case["greedy_ids"])
    stop = full[5:9]
    prompts = _prompts(6, pair[0].model_config.vocab_size, seed=2)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(n=2, max_tokens=16, temperature=0.7, seed=None, stop=["e"], ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[case["greedy_ids"][3]]),
        SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=9, top_k=5, ignore_eos=True),
    ]
    sync, overlap = _both(pair, prompts, params)
    assert sync[0].outputs[0].text == full[: full.index(stop)] and sync[0].outputs[0].stop_reason == stop
    seeded = [i for i, p in enumerate(params) if p.seed is not None or p.temperature == 0]
    assert [_summary(sync)[i] for i in seeded] == [_summary(overlap)[i] for i in seeded]
    assert [len(r.outputs) for r in overlap] == [p.n for p in params]


def test_streams_concatenate(pair):
    case = reference("tiny-llama")["cases"][2]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chunks = list(pair[1].stream({"prompt_token_ids": case["prompt_ids"]}, sp))
    assert chunks[-1].finished and chunks[-1].outputs[0].token_ids == case["greedy_ids"]
    assert "".join(c.outputs[0].delta_text for c in chunks) == chunks[-1].outputs[0].text
    _check_idle(pair[1])


def test_preemption_identical():
    prompts = _prompts(12, 512, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate([0, 1] * 6)]
    outs = []
    for overlap in (False, True):
        llm = LLM(MODEL, async_scheduling=overlap, **{**KW, "num_kv_pages": 10})
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0
        _check_idle(llm)
    assert _summary(outs[0]) == _summary(outs[1])


def test_structured_output_identical():
    so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}")
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in reference("tiny-qwen3")["cases"]]
    params = [
        SamplingParams(max_tokens=16, temperature=0, structured_outputs=so),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, structured_outputs=so),
        SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=4, structured_outputs=choice),
    ][: len(prompts)]
    outs = []
    for overlap in (False, True):
        llm = LLM(FIXTURES / "tiny-qwen3", warmup=False, num_kv_pages=64, max_num_seqs=8, async_scheduling=overlap)
        outs.append(llm.generate(prompts[: len(params)], params, use_tqdm=False))
        _check_idle(llm)
    assert _summary(outs[0]) == _summary(outs[1])
    assert all(o.finish_reason == "stop" for r in outs[1] for o in r.outputs)


def test_prompt_logprobs_from_ordinary_steps(pair):
    """Prompt logprobs come out of the scheduled prefill (chunked here: 64-token steps, prompts up to 120 tokens),
    equal the full-prompt logits, ignore prefix-cache hits, and are the same with and without overlap."""
    llm = pair[1]
    rng = random.Random(5)
    vocab = llm.model_config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(120)]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=4)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)  # puts the prompt in the prefix cache
    outs = {}
    for name, engine in zip(("sync", "overlap"), pair, strict=True):
        outs[name] = engine.generate([{"prompt_token_ids": prompt}] * 2, [sp, plain], use_tqdm=False)
        _check_idle(engine)
    got = outs["overlap"][0]
    assert got.num_cached_tokens == 0 and outs["overlap"][1].num_cached_tokens > 0
    assert got.outputs[0].token_ids == outs["overlap"][1].outputs[0].token_ids
    logits = llm.logits(prompt).astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
    for i, tok in enumerate(prompt[1:]):
        entry = got.prompt_logprobs[i + 1]
        assert abs(entry[tok].logprob - lp[i, tok]) < 1e-4
        assert entry[tok].rank == int((lp[i] > lp[i, tok]).sum()) + 1
        assert set(entry) == set(np.argsort(-lp[i])[:4].tolist()) | {tok}
    for a, b in zip(got.prompt_logprobs[1:], outs["sync"][0].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-5)


def test_prompt_logprobs_stream_whole_with_n_samples():
    """n = 2: only the first sample computes the prompt's rows (at most 256 a step), so its sibling streams tokens
    first; no streamed output may carry a partly filled prompt_logprobs list, and the last one has every row."""
    llm = LLM(
        FIXTURES / "tiny-llama",
        dtype="float32",
        warmup=False,
        max_num_seqs=6,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )
    prompt = {"prompt_token_ids": [(i * 7) % 200 + 3 for i in range(450)]}
    outs = list(llm.stream(prompt, SamplingParams(max_tokens=3, n=2, prompt_logprobs=1)))
    assert outs[0].prompt_logprobs is None  # the sibling's first token came before the last prompt rows
    for out in outs:
        assert out.prompt_logprobs is None or all(e is not None for e in out.prompt_logprobs[1:])
    final = outs[-1].prompt_logprobs
    assert outs[-1].finished and final[0] is None and len(final) == 450 and all(e is not None for e in final[1:])
    _check_idle(llm)


@pytest.mark.parametrize("which", ["sync", "overlap"])
def test_an_error_inside_a_step_leaves_no_request_stuck(pair, which, monkeypatch):
    """An exception while a step's tokens are being processed (here the output processor's, once) propagates, and
    the steps whose results were not applied are unscheduled: every request then runs to its end and nothing leaks."""
    llm = pair[which == "overlap"]
    engine = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts(6, llm.model_config.vocab_size, seed=8)):
        engine.add_request(f"e{i}", p, sp)
    real = engine.outputs.append_token
    calls = 0

    def flaky(*args, **kw):
        nonlocal calls
        calls += 1
        if calls == 9:
            raise RuntimeError("detokenizer failure")
        return real(*args, **kw)

    monkeypatch.setattr(engine.outputs, "append_token", flaky)
    with pytest.raises(RuntimeError, match="detokenizer failure"):
        for _ in range(50):
            engine.step()
    finished = set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"e{i}" for i in range(6)}
    _check_idle(llm)


def test_aborts_in_flight_leak_nothing(pair):
    llm = pair[1]
    engine = llm.engine
    prompts = _prompts(8, llm.model_config.vocab_size, seed=6)
    sp = SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, sp)
    for n in range(6):
        engine.step()
        engine.abort_request(f"a{n}")  # a step for it is in flight: its token must be dropped
    assert engine._in_flight is not None
    while engine.has_unfinished_requests():  # includes the last in-flight step, for requests that are all gone
        for out in engine.step():
            assert not out.request_id.startswith(("a0", "a1", "a2", "a3", "a4", "a5"))
    assert engine._in_flight is None
    _check_idle(llm)
