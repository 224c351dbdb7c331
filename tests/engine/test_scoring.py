"""LLM.score_continuations: continuation logprobs equal transformers' (its logits, and its lm-eval loglikelihoods of
text pairs), is_greedy, a batch equals one pair at a time, shared prompts hit the prefix cache, no compilation per
length after warm-up, and bad input or a failure mid-run leaves no request or KV block behind."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from support.checkpoints import FIXTURES, REPO, reference
from support.compiles import compiled_jits

from netra_jax import LLM, ContinuationScore

LM_EVAL = REPO / "tests" / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def llm():
    return LLM(
        FIXTURES / "tiny-llama", dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, page_size=16, warmup=True
    )


@pytest.fixture(scope="module")
def qwen3():
    return LLM(FIXTURES / "tiny-qwen3", dtype="float32", max_num_seqs=16, max_num_batched_tokens=512, warmup=False)


def _check_idle(llm):
    pool = llm.engine.pool
    pool.check_invariant()
    assert pool.num_in_use == 0
    assert not llm.engine.has_unfinished_requests()


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_token_logprobs_equal_transformers(model, request):
    """Every split of each reference prompt into (prompt, continuation), scored in one batch: each continuation
    token's logprob and rank are those of log_softmax(transformers' logits) at the position before it."""
    engine = request.getfixturevalue("llm" if model == "tiny-llama" else "qwen3")
    cases = reference(model)["cases"]
    pairs = [(c, k) for c in cases for k in range(1, len(c["prompt_ids"]), 3)]
    scores = engine.score_continuations(
        [c["prompt_ids"][:k] for c, k in pairs], [c["prompt_ids"][k:] for c, k in pairs]
    )
    assert len(scores) == len(pairs)
    for (case, k), s in zip(pairs, scores, strict=True):
        ids = case["prompt_ids"]
        lp = log_softmax(case["logits"])  # [len(ids), vocab]
        want = [lp[k - 1 + i, t] for i, t in enumerate(ids[k:])]
        assert s.prompt_token_ids == ids[:k] and s.continuation_token_ids == ids[k:]
        np.testing.assert_allclose(s.token_logprobs, want, atol=1e-4)
        for i, (w, rank) in enumerate(zip(want, s.ranks, strict=True)):  # rank: 1 + tokens more likely (ties aside)
            assert (lp[k - 1 + i] > w + 1e-4).sum() < rank <= (lp[k - 1 + i] > w - 1e-4).sum() + 1
        assert abs(s.logprob - sum(want)) < 1e-3
        assert s.is_greedy == all(r == 1 for r in s.ranks)
    _check_idle(engine)


def test_is_greedy_on_transformers_greedy_tokens(llm):
    """transformers' greedy continuation of each reference prompt is greedy; changing its last token makes it not."""
    cases = reference("tiny-llama")["cases"]
    prompts, conts = [], []
    for c in cases:
        greedy = c["greedy_ids"][:6]
        other = (greedy[-1] + 1) % llm.model_config.vocab_size
        prompts += [c["prompt_ids"]] * 2
        conts += [greedy, greedy[:-1] + [other]]
    scores = llm.score_continuations(prompts, conts)
    assert [s.is_greedy for s in scores] == [True, False] * len(cases)
    for s in scores[::2]:
        assert s.ranks == [1] * 6
    _check_idle(llm)


def test_text_pairs_equal_transformers_loglikelihoods(qwen3):
    """The lm-eval task's 160 (question, " " + choice) text pairs, tokenized as lm-eval pairs them, give transformers'
    loglikelihoods (tests/fixtures/lm_eval/reference-tiny-qwen3.json, written by make_reference.py there)."""
    ref = json.loads((LM_EVAL / "reference-tiny-qwen3.json").read_text())
    docs = [json.loads(line) for line in (LM_EVAL / "mc.jsonl").read_text().splitlines() if line.strip()]
    prompts = [d["question"] for d in docs for _ in d["choices"]]
    conts = [" " + ch for d in docs for ch in d["choices"]]
    scores = qwen3.score_continuations(prompts, conts)
    want = [x for d in ref["docs"] for x in d["loglikelihoods"]]
    assert len(scores) == len(want) == 160
    np.testing.assert_allclose([s.logprob for s in scores], want, atol=2e-4)
    tok = qwen3.get_tokenizer()
    for p, c, s in zip(prompts, conts, scores, strict=True):  # the continuation is tokenized in its context
        assert s.prompt_token_ids + s.continuation_token_ids == tok.encode(p + c, add_special_tokens=False)
        assert s.prompt_token_ids == tok.encode(p, add_special_tokens=False)


def _shared_prompt_pairs(vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Multiple-choice style pairs of fresh random tokens: 6 prompts of 20-90 tokens with 2-5 continuations each."""
    rng = random.Random(seed)
    prompts, conts = [], []
    for _ in range(6):
        p = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 90))]
        for _ in range(rng.randrange(2, 6)):
            prompts.append(p)
            conts.append([rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))])
    order = list(range(len(prompts)))
    rng.shuffle(order)  # siblings need not be adjacent
    return [prompts[i] for i in order], [conts[i] for i in order]


def test_batch_equals_one_at_a_time_and_hits_prefix_cache(llm):
    pool, bs = llm.engine.pool, llm.engine.pool.block_size
    prompts, conts = _shared_prompt_pairs(llm.model_config.vocab_size, seed=3)
    hits0, queries0 = pool.prefix_hits_tokens, pool.prefix_queries_tokens
    batch = llm.score_continuations(prompts, conts)
    # every pair after the first of its prompt reuses the prompt's full blocks before the continuation's first row
    first: set[tuple[int, ...]] = set()
    expected = []
    for p in prompts:
        expected.append(0 if tuple(p) not in first else (len(p) - 1) // bs * bs)
        first.add(tuple(p))
    assert [s.num_cached_tokens for s in batch] == expected
    assert pool.prefix_hits_tokens - hits0 == sum(expected) > 0
    assert pool.prefix_queries_tokens - queries0 == sum(len(p) + len(c) for p, c in zip(prompts, conts, strict=True))
    _check_idle(llm)
    for p, c, s in zip(prompts, conts, batch, strict=True):
        alone = llm.score_continuations([p], [c])[0]
        assert alone.continuation_token_ids == s.continuation_token_ids
        np.testing.assert_allclose(alone.token_logprobs, s.token_logprobs, atol=1e-5)
        assert alone.ranks == s.ranks and alone.is_greedy == s.is_greedy
    _check_idle(llm)


def test_context_takes_no_prompt_logprob_rows(qwen3):
    """A step computes at most PROMPT_LOGPROB_ROWS (256) prompt-logprob rows, and the context before a continuation
    needs none: 400 context + 20 continuation tokens are one step; 100 + 300 are two (the first ends at the 256th
    row). Both score as the per-prompt logits hook (its own forward, outside the engine's steps) says."""
    rng = random.Random(9)
    vocab = qwen3.model_config.vocab_size
    for n_ctx, n_cont, n_steps in ((400, 20, 1), (100, 300, 2)):
        ctx = [rng.randrange(3, vocab) for _ in range(n_ctx)]
        cont = [rng.randrange(3, vocab) for _ in range(n_cont)]
        steps = qwen3.engine.runner.num_steps
        s = qwen3.score_continuations([ctx], [cont])[0]
        assert qwen3.engine.runner.num_steps - steps == n_steps
        lp = log_softmax(qwen3.logits(ctx + cont))
        np.testing.assert_allclose(s.token_logprobs, [lp[n_ctx - 1 + i, t] for i, t in enumerate(cont)], atol=1e-4)
    _check_idle(qwen3)


def test_no_compilation_per_length_after_warmup(llm):
    """Pairs of many prompt and continuation lengths, in waves of different sizes, compile no step or sampler
    program; the control (LLM.logits at a length it has not seen: its own program per length) shows the counter
    sees compilations."""
    rng = random.Random(7)
    vocab = llm.model_config.vocab_size
    with compiled_jits() as compiled:
        for n in (1, 5, 17, 40):
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 200))] for _ in range(n)]
            conts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(n)]
            scores = llm.score_continuations(prompts, conts)
            assert [len(s.token_logprobs) for s in scores] == [len(c) for c in conts]
        after = list(compiled)
        llm.logits([5] * 300)
    steps = [n for n in after if n in ("_step", "sample_tokens", "token_logprobs", "_widen_ids")]
    assert steps == [], f"compiled after warm-up: {steps}"
    assert "_all_logits" in compiled[len(after) :]
    _check_idle(llm)


def test_text_and_token_id_forms(llm):
    """A text pair is tokenized in context; a text prompt with a token-id continuation scores those ids after the
    prompt's own tokens; a single pair may be given without lists."""
    tok = llm.get_tokenizer()
    ctx = tok.encode("The quick brown fox", add_special_tokens=False)
    cont = tok.encode(" jumps over", add_special_tokens=False)
    one = llm.score_continuations("The quick brown fox ", "jumps over")  # the trailing space moves on
    assert len(one) == 1 and isinstance(one[0], ContinuationScore)
    whole = tok.encode("The quick brown fox jumps over", add_special_tokens=False)
    assert one[0].prompt_token_ids + one[0].continuation_token_ids == whole
    ids = llm.score_continuations(["The quick brown fox", ctx], [cont, cont])
    assert ids[0].prompt_token_ids == ids[1].prompt_token_ids == ctx
    assert ids[0].token_logprobs == ids[1].token_logprobs
    _check_idle(llm)


@pytest.mark.parametrize(
    "prompts, conts, match",
    [
        (["a", "b"], ["c"], "2 prompts for 1 continuations"),
        (["hello"], [""], "empty continuation"),
        ([[5, 6]], [[]], "continuation .* no tokens"),
        ([""], [" x"], "empty prompt"),
        ([[]], [[5]], "prompt .* no tokens"),
        ([[5, 6]], [" x"], "needs a text prompt"),
        ([[5, 6]], [[7, 10**6]], "outside the vocabulary"),
        ([[5] * 400], [[6] * 112], "does not fit the model's context of 512"),
        ([[5, 6]], [[7, 1.5]], "integers"),
    ],
)
def test_bad_input_rejected_before_anything_runs(llm, prompts, conts, match):
    steps = llm.engine.runner.num_steps
    with pytest.raises(ValueError, match=match):
        llm.score_continuations(prompts, conts)
    assert llm.engine.runner.num_steps == steps
    _check_idle(llm)


@pytest.mark.parametrize("where", ["add", "step"])
def test_failure_mid_call_leaks_nothing(llm, monkeypatch, where):
    """A failure while the pairs are queued or while they run aborts every pair of the call and frees its blocks;
    the next call scores as before."""
    prompts, conts = _shared_prompt_pairs(llm.model_config.vocab_size, seed=5)
    want = llm.score_continuations(prompts, conts)
    eng, calls = llm.engine, []
    real = getattr(eng, "add_request" if where == "add" else "step")

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng, "add_request" if where == "add" else "step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.score_continuations(prompts, conts)
    monkeypatch.undo()
    eng.settle()  # a step dispatched before the failure is read back (its requests are gone)
    _check_idle(llm)
    again = llm.score_continuations(prompts, conts)
    for a, b in zip(again, want, strict=True):
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-5)
    _check_idle(llm)
