"""A batch-invariant engine's sampled-token logprobs (raw and processed) equal `netra_jax.rl.sequence_logprobs` bit for
bit on every fixture family in float32 and bfloat16, whatever else is in the batch, under chunked prefill, prefix-cache
hits and preemption; a request alone and beside others gets the same tokens and values; the trainer function is
differentiable (checked against finite differences); the invariant kernels agree with the jnp references."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, MOE_MODELS, TINY_MODELS

from netra_jax import LLM, SamplingParams
from netra_jax.ops import cpu_matmul
from netra_jax.ops.attention import BACKENDS, paged_attention_reference
from netra_jax.ops.attention.paged_batch import build_batch
from netra_jax.rl import SequenceLogprobs, sequence_logprobs

SAMPLED = SamplingParams(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, seed=11, logprobs=0, ignore_eos=True)
OTHERS = [  # the companions' parameters: greedy, min-p, penalties with bias and min_tokens, top-k alternatives
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=0),
    SamplingParams(max_tokens=14, temperature=1.0, min_p=0.05, seed=2, logprobs=0, ignore_eos=True),
    SamplingParams(
        max_tokens=10,
        temperature=0.8,
        top_p=0.8,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={5: 2.0, 7: -3.0},
        min_tokens=4,
        seed=3,
        logprobs=2,
    ),
    SamplingParams(max_tokens=11, temperature=0.7, top_k=40, top_p=0.9, seed=4, logprobs=0, n=2, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.3, top_k=3, seed=5, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=13, temperature=0.7, top_k=40, top_p=0.9, seed=6, logprobs=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.5, seed=7, logprobs=0, ignore_eos=True),
]


def _prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    """The request followed alone and in company (a 40-token prompt), and seven companions of 5 to 70 tokens, the
    first sharing its first 32 tokens (two whole pages: a prefix-cache hit)."""
    rng = random.Random(3)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    main = ids(40)
    others = [main[:32] + ids(9), ids(5), ids(70), ids(23), ids(50), ids(12), ids(64)]
    return main, others


def _values(completion) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(completion.raw_logprobs, np.float32), np.asarray(completion.processed_logprobs, np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", TINY_MODELS + MOE_MODELS)
def test_engine_logprobs_equal_sequence_logprobs(model, dtype):
    # 32 tokens a step (the longer prompts are chunked), 12 pages of 16 tokens (requests are preempted and
    # recomputed), prefix caching on
    llm = LLM(
        FIXTURES / model,
        dtype=dtype,
        batch_invariant=True,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_kv_pages=12,
    )
    cfg = llm.model_config
    main, others = _prompts(cfg.vocab_size)
    alone = llm.generate({"prompt_token_ids": main}, SAMPLED, use_tqdm=False)[0].outputs[0]
    hits = llm.engine.pool.prefix_hits_tokens
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in [main, *others]], [SAMPLED, *OTHERS], use_tqdm=False
    )  # the main request beside seven others
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.pool.prefix_hits_tokens > hits

    beside = outs[0].outputs[0]
    assert beside.token_ids == alone.token_ids
    for a, b in zip(_values(alone), _values(beside), strict=True):
        np.testing.assert_array_equal(a, b)

    prompts, outputs, params, engine = [], [], [], []
    for out, sp in zip(outs, [SAMPLED, *OTHERS], strict=True):
        for c in out.outputs:
            prompts.append(out.prompt_token_ids)
            outputs.append(c.token_ids)
            params.append(sp)
            engine.append(_values(c))
            assert len(c.raw_logprobs) == len(c.processed_logprobs) == len(c.token_ids)
            assert c.cumulative_logprob == pytest.approx(float(np.sum(c.raw_logprobs, dtype=np.float64)))
    trainer = sequence_logprobs(llm.params, cfg, prompts, outputs, params)
    for (raw, processed), got in zip(engine, trainer, strict=True):
        np.testing.assert_array_equal(raw, np.asarray(got.raw))
        np.testing.assert_array_equal(processed, np.asarray(got.processed))
    greedy = engine[1][1]
    assert np.all(processed <= 0.0) and np.all(greedy <= 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_invariant_kernels_match_references_and_ignore_the_batch(dtype):
    """The batch-invariant matmul and attention kernels: close to the jnp references, and a row's bits the same
    whatever rows share the call (bfloat16 weights and pages read as stored)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((96, 80)), dtype)
    x = jnp.asarray(rng.standard_normal((70, 96)), jnp.float32)
    full = np.asarray(cpu_matmul.invariant_matmul(x, w))  # [70, 80] float32
    np.testing.assert_allclose(full, np.asarray(x) @ np.asarray(w, np.float32), rtol=1e-5, atol=1e-4)
    for rows in (1, 3, 8, 33):
        np.testing.assert_array_equal(np.asarray(cpu_matmul.invariant_matmul(x[5 : 5 + rows], w)), full[5 : 5 + rows])

    H, KH, D, page = 4, 2, 16, 8
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((40, page, KH, D)), dtype) for _ in range(2))
    tables = [list(range(0, 10)), list(range(10, 30))]  # two sequences' pages: 70 and 150 keys
    q = jnp.asarray(rng.standard_normal((45, H, D)), dtype)  # 40 prompt rows of the first, 5 of the second
    kw = dict(scale=D**-0.5, sliding_window=None, soft_cap=None, sinks=None)
    both = build_batch([70, 150], [40, 5], tables, page_size=page, num_pages=40, num_tokens=45)
    out = np.asarray(BACKENDS["cpu_invariant"](q, k_pages, v_pages, both.metadata, **kw), np.float32)
    ref = np.asarray(paged_attention_reference(q, k_pages, v_pages, both.metadata, **kw), np.float32)
    np.testing.assert_allclose(out, ref, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=2e-2)
    alone = build_batch([150], [5], tables[1:], page_size=page, num_pages=40, num_tokens=8)
    q_alone = jnp.zeros((8, H, D), dtype).at[:5].set(q[40:])
    got = np.asarray(BACKENDS["cpu_invariant"](q_alone, k_pages, v_pages, alone.metadata, **kw), np.float32)
    np.testing.assert_array_equal(got[:5], out[40:])


def test_processed_logprobs_follow_the_sampling_distribution():
    """With top_k=3 the processed distribution has three tokens: their probabilities (from the trainer function at
    each of the three) sum to one; raw values are the full softmax's, so smaller."""
    llm = LLM(FIXTURES / "tiny-llama", dtype="float32", batch_invariant=True, max_num_seqs=4)
    cfg = llm.model_config
    prompt = list(range(3, 20))
    sp = SamplingParams(max_tokens=1, temperature=1.3, top_k=3, seed=1, logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    top3 = [t for t, lp in out.logprobs[0].items() if lp.rank is not None and lp.rank <= 3]
    got = sequence_logprobs(llm.params, cfg, [prompt] * 3, [[t] for t in top3], sp)
    probs = np.exp(np.concatenate([np.asarray(g.processed, np.float64) for g in got]))
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)
    assert out.token_ids[0] in top3
    raw = np.concatenate([np.asarray(g.raw) for g in got])
    np.testing.assert_array_equal(raw, [out.logprobs[0][t].logprob for t in top3])
    outside = sequence_logprobs(llm.params, cfg, prompt, [next(t for t in range(cfg.vocab_size) if t not in top3)], sp)
    assert float(outside.processed[0]) == -np.inf


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_sequence_logprobs_gradient_matches_finite_differences(model):
    llm = LLM(FIXTURES / model, dtype="float32", batch_invariant=True)
    cfg, params = llm.model_config, llm.params
    prompt, output = list(range(3, 15)), [17, 40, 9, 300]
    sp = SamplingParams(temperature=0.8)  # no filter: a nucleus' edge would move within the finite difference

    def loss(scale, which):
        p = jax.tree.map(lambda a: a, params)
        p = {**p, "final_norm": p["final_norm"] * scale}
        r = sequence_logprobs(p, cfg, prompt, output, sp)
        return jnp.sum(getattr(r, which))

    for which in ("raw", "processed"):
        g = jax.grad(loss)(jnp.float32(1.0), which)
        eps = 1e-3
        fd = (loss(jnp.float32(1 + eps), which) - loss(jnp.float32(1 - eps), which)) / (2 * eps)
        assert float(g) == pytest.approx(float(fd), rel=2e-2, abs=2e-3)
    full = jax.grad(lambda p: jnp.sum(sequence_logprobs(p, cfg, prompt, output, sp).raw))(
        jax.tree.map(lambda a: a, params)
    )
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(full))
    assert float(jnp.abs(full["embed"]).sum()) > 0


def test_sequence_logprobs_under_jit_equals_eager():
    llm = LLM(FIXTURES / "tiny-qwen3", dtype="bfloat16", batch_invariant=True)
    cfg = llm.model_config
    prompt, output = list(range(5, 30)), [11, 12, 13]
    sp = SamplingParams(temperature=0.7, top_k=40)
    eager = sequence_logprobs(llm.params, cfg, prompt, output, sp)
    jitted = jax.jit(lambda p: sequence_logprobs(p, cfg, prompt, output, sp))(llm.params)
    assert isinstance(jitted, SequenceLogprobs)
    np.testing.assert_array_equal(np.asarray(eager.raw), np.asarray(jitted.raw))
    np.testing.assert_array_equal(np.asarray(eager.processed), np.asarray(jitted.processed))
    (value, _), grads = jax.value_and_grad(
        lambda p: (jnp.sum(sequence_logprobs(p, cfg, prompt, output, sp).raw), 0), has_aux=True
    )(llm.params)
    assert float(value) == float(jnp.sum(eager.raw))
    assert grads["lm_head"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2], [], SamplingParams()), "at least one token"),
        (([1, 2], [10**6], SamplingParams()), "outside the vocabulary"),
        (([[1, 2], [3]], [[4]], SamplingParams()), "2 prompts for 1 outputs"),
        (([1, 2], [3], SamplingParams(top_p=0.0)), "top_p"),
        (([1, 2], [3], SamplingParams(structured_outputs={"regex": "a+"})), "structured outputs"),
    ],
)
def test_sequence_logprobs_refuses_bad_input(args, match):
    llm = LLM(FIXTURES / "tiny-llama", dtype="float32", batch_invariant=True)
    with pytest.raises(ValueError, match=match):
        sequence_logprobs(llm.params, llm.model_config, *args)


def test_batch_invariant_option_refuses_conflicts():
    with pytest.raises(ValueError, match="matmul_backend='xla' conflicts"):
        LLM(FIXTURES / "tiny-llama", batch_invariant=True, matmul_backend="xla")
    with pytest.raises(ValueError, match="without LoRA"):
        LLM(FIXTURES / "tiny-llama", batch_invariant=True, enable_lora=True)
