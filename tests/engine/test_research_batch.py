"""Batched research calls on a tiny fixture: run_with_cache over many prompts against one call per prompt, hooks per
request in generate beside unhooked traffic (n > 1 too) and on the async engine, edits of the attention pattern,
activation patching sweeps against the one-call-per-patch loop, and compiled programs reused across new function
objects. References: each prompt run alone, the engine's unhooked output, the model's algebra (a one-hot pattern
reads the values; patching the last layer's stream at the last position gives the clean logits)."""

from __future__ import annotations

import asyncio
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.compiles import compiled_jits

from netra_jax import LLM, Hooks, SamplingParams, patch, patching_sweep
from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.models.hooks import hook_name

MODEL = "tiny-llama"
REF = reference(MODEL)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(FIXTURES / MODEL), max_num_seqs=16, max_num_batched_tokens=128, num_kv_pages=96)


def _prompt(i: int) -> list[int]:
    return REF["cases"][i % len(REF["cases"])]["prompt_ids"]


def _greedy(tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **kw)


def _check_idle(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.pool.check_invariant()
    assert eng.pool.num_in_use == 0
    assert not eng.runner._hooked and not eng.runner._hook_sets


def _steer(x, ctx):
    return x + ctx.data.astype(x.dtype)


def test_run_with_cache_equals_one_call_per_prompt(llm):
    prompts = [_prompt(i)[: 5 + 3 * i] for i in range(6)]  # ragged lengths, batched in shared steps
    names = list(llm.hook_points())
    cached = llm.run_with_cache(prompts, names=names)
    for ids, run in zip(prompts, cached, strict=True):
        alone = llm.run_with_hooks(ids, Hooks(record=names))
        assert run.token_ids == ids
        assert set(run.activations) == set(names)
        for name in names:
            assert run[name].shape == alone.activations[name].shape, name
            np.testing.assert_allclose(run[name], alone.activations[name], atol=2e-5, err_msg=name)
        np.testing.assert_allclose(run["logits"], alone.logits, atol=2e-5)
        T = len(ids)
        assert run["layers.0.pattern"].shape == (T, llm.model_config.num_heads, T)
    _check_idle(llm)


def test_hooks_per_request_beside_unhooked_traffic_and_n_samples(llm):
    cfg = llm.model_config
    point = hook_name(1, "resid_post")
    vector = np.random.default_rng(0).normal(size=cfg.hidden_size).astype(np.float32) * 4
    steer = Hooks(edit={point: _steer}, data={point: vector}, record=[point])
    other = Hooks(edit={point: _steer}, data={point: -vector})
    plain = llm.generate([_prompt(0), _prompt(1), _prompt(2)], _greedy(), use_tqdm=False)
    alone = llm.generate([_prompt(0)], _greedy(), use_tqdm=False, hooks=steer)[0]
    other_alone = llm.generate([_prompt(2)], _greedy(), use_tqdm=False, hooks=other)[0]
    assert alone.outputs[0].token_ids != plain[0].outputs[0].token_ids  # the steering does something
    mixed = llm.generate([_prompt(0), _prompt(1), _prompt(2)], _greedy(), use_tqdm=False, hooks=[steer, None, other])
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == plain[1].outputs[0].token_ids  # the unhooked neighbour is untouched
    assert mixed[2].outputs[0].token_ids == other_alone.outputs[0].token_ids
    np.testing.assert_allclose(mixed[0].activations[point], alone.activations[point], atol=2e-5)
    assert mixed[1].activations is None
    # n > 1: every sample runs the hooks and carries its own activations
    two = llm.generate([_prompt(0)], _greedy(n=2), use_tqdm=False, hooks=steer)[0]
    assert [c.token_ids for c in two.outputs] == [alone.outputs[0].token_ids] * 2
    for c in two.outputs:
        np.testing.assert_allclose(c.activations[point], alone.activations[point], atol=2e-5)
    _check_idle(llm)


def test_hooked_request_joins_a_running_engine(llm):
    eng = llm.engine
    point = hook_name(0, "resid_post")
    vector = np.ones(llm.model_config.hidden_size, np.float32) * 3
    steer = Hooks(edit={point: _steer}, data={point: vector})
    want_plain = llm.generate([_prompt(3)], _greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    want_hooked = llm.generate([_prompt(4)], _greedy(8), use_tqdm=False, hooks=steer)[0].outputs[0].token_ids
    eng.add_request("plain", {"prompt_token_ids": _prompt(3)}, _greedy(8))
    eng.step()
    eng.step()  # the plain request is decoding when the hooked one arrives
    eng.add_request("hooked", {"prompt_token_ids": _prompt(4)}, _greedy(8), hooks=steer)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    eng.settle()
    assert done == {"plain": want_plain, "hooked": want_hooked}
    _check_idle(llm)


def test_async_engine_runs_hooked_and_plain_requests_together(llm):
    point = hook_name(1, "mlp_out")
    steer = Hooks(edit={point: lambda x, ctx: x * 0}, record=[hook_name(0, "resid_pre")])
    want = llm.generate([_prompt(0), _prompt(1)], _greedy(), use_tqdm=False, hooks=[steer, None])

    async def run():
        engine = AsyncEngine(llm.engine)
        try:

            async def last(rid, prompt, hooks):
                outs = [o async for o in engine.generate({"prompt_token_ids": prompt}, _greedy(), rid, hooks=hooks)]
                return outs[-1]

            return await asyncio.gather(last("a", _prompt(0), steer), last("b", _prompt(1), None))
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    np.testing.assert_allclose(
        got[0].activations[hook_name(0, "resid_pre")], want[0].activations[hook_name(0, "resid_pre")]
    )
    _check_idle(llm)


def test_pattern_is_recorded_and_edits_recompute_attention(llm):
    cfg = llm.model_config
    ids = _prompt(1)
    T, layer = len(ids), 1
    rec = [hook_name(layer, p) for p in ("pattern", "v", "attn_heads")]
    base = llm.run_with_hooks(ids, Hooks(record=rec))
    pattern = base.activations[rec[0]]  # [T, heads, T]
    np.testing.assert_allclose(pattern.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(pattern.transpose(1, 0, 2), k=1) == 0)  # causal
    # the same probabilities written back: the attention (and logits) unchanged
    same = llm.run_with_hooks(ids, Hooks(edit={rec[0]: lambda p, ctx: p * 1.0}))
    np.testing.assert_allclose(same.logits, base.logits, atol=1e-4)

    # every query attends only to itself: each head's output is its KV head's value at that position
    def diagonal(p, ctx):
        return jnp.broadcast_to(jnp.eye(p.shape[-1], dtype=p.dtype)[ctx.positions][:, None, :], p.shape)

    own = llm.run_with_hooks(ids, Hooks(edit={rec[0]: diagonal}, record=rec))
    v = own.activations[rec[1]]  # [T, kv_heads, head_dim]
    group = cfg.num_heads // cfg.num_kv_heads
    np.testing.assert_allclose(own.activations[rec[2]], np.repeat(v, group, axis=1), atol=1e-5)
    # in the engine, with the pattern spanning the longest hooked sequence only
    out = llm.generate([ids], _greedy(3), use_tqdm=False, hooks=Hooks(record=[rec[0]]))[0]
    n = T + 2
    assert out.activations[rec[0]].shape == (n, cfg.num_heads, n)
    np.testing.assert_allclose(out.activations[rec[0]][:T, :, :T], pattern, atol=2e-5)
    _check_idle(llm)


def test_patching_sweep_equals_the_loop_and_patching_the_last_stream_restores_the_clean_logits(llm):
    cfg = llm.model_config
    clean = _prompt(0)[:9]
    corrupted = clean[:4] + _prompt(1)[4:9]  # the last five tokens differ
    points = [hook_name(i, "resid_pre") for i in range(cfg.num_layers)] + [hook_name(cfg.num_layers - 1, "resid_post")]
    sweep = patching_sweep(llm, clean, corrupted, points)
    assert sweep.logits.shape == (len(points), 9, cfg.vocab_size)
    source = llm.run_with_cache([clean], names=points)[0]
    for i, name in enumerate(points):
        for p in (0, 4, 8):
            mask = np.arange(9) == p
            one = llm.run_with_hooks(
                corrupted, Hooks(edit={name: patch}, data={name: {"values": source[name], "mask": mask}})
            )
            np.testing.assert_allclose(sweep.logits[i, p], one.logits[-1], atol=1e-4, err_msg=f"{name} @ {p}")
    np.testing.assert_allclose(sweep.logits[-1, -1], sweep.clean_logits, atol=1e-4)
    np.testing.assert_allclose(sweep.logits[0, 0], sweep.corrupted_logits, atol=1e-4)  # a position alike in both
    np.testing.assert_allclose(sweep.corrupted_logits, llm.logits(corrupted)[-1], atol=1e-4)
    _check_idle(llm)


def test_a_new_function_with_the_same_code_reuses_the_compiled_step(llm):
    ids = _prompt(2)
    point = hook_name(0, "resid_post")

    def make(scale):
        vec = np.full(llm.model_config.hidden_size, scale, np.float32)  # captured: lifted to a traced argument
        return Hooks(edit={point: lambda x, ctx: x + vec}, record=[point])

    first = llm.run_with_hooks(ids, make(1.0))
    with compiled_jits() as compiled:
        second = llm.run_with_hooks(ids, make(2.0))  # a new lambda, a new array of the same shape
    assert not compiled, compiled
    np.testing.assert_allclose(second.activations[point] - first.activations[point], 1.0, atol=1e-5)

    def unkeyable(x, ctx, table=[1.0]):  # noqa: B006 - a default that does not hash
        return x * table[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.run_with_hooks(ids, Hooks(edit={point: unkeyable}))
    assert any("keyed by identity" in str(w.message) for w in caught)


def test_hooks_with_speculative_decoding_are_refused_clearly():
    from netra_jax import SpeculativeConfig

    llm = LLM(
        str(FIXTURES / MODEL),
        max_num_seqs=4,
        num_kv_pages=32,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
    )
    with pytest.raises(ValueError, match="speculative decoding"):
        llm.generate([_prompt(0)], _greedy(2), use_tqdm=False, hooks=Hooks(record=["logits"]))
    assert llm.generate([_prompt(0)], _greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_logits_edit_steers_sampling_of_its_own_request_only(llm):
    def force(logits, ctx):  # [T, vocab]: every row's maximum at ctx.data
        return logits.at[:, ctx.data].set(logits.max() + 100.0)

    token = np.int32(7)
    outs = llm.generate(
        [_prompt(0), _prompt(1)],
        _greedy(4),
        use_tqdm=False,
        hooks=[Hooks(edit={"logits": force}, data={"logits": token}, record=["logits"]), None],
    )
    assert outs[0].outputs[0].token_ids == [7] * 4
    assert outs[0].activations["logits"].shape == (len(_prompt(0)) + 3, llm.model_config.vocab_size)
    assert outs[1].outputs[0].token_ids == REF["cases"][1]["greedy_ids"][:4]
    _check_idle(llm)
