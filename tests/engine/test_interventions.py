"""Interventions through the supported API on a tiny fixture: hook points that record or edit activations inside
the jitted step (head ablation, a steering vector, activation patching, the logit lens), weight swaps with the prefix
cache invalidated, each checked against a reference: the transformers logits, the pure forward of the layers after
the hook point, or the engine's own output with equivalently modified weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.compiles import compiled_jits

from netra_jax import LLM, SamplingParams
from netra_jax.models.hooks import Hooks, hook_name
from netra_jax.models.transformer import forward_dense, logit_lens

MODEL = "tiny-llama"
REF = reference(MODEL)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(FIXTURES / MODEL), max_num_seqs=8, max_num_batched_tokens=256, num_kv_pages=64)


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return REF["cases"][i]["prompt_ids"]


def _from_layer(llm, k: int):
    """(cfg, params) of the model from layer k on: a pure function of the residual stream entering layer k, run by
    `forward_dense` with that stream as its input embeddings."""
    cfg, params = llm.model_config, dict(llm.params)
    params["layers"] = params["layers"][k:]
    cut = {"num_layers": cfg.num_layers - k}
    for name in ("layer_types", "moe_layers"):
        if getattr(cfg, name):
            cut[name] = getattr(cfg, name)[k:]
    return dataclasses.replace(cfg, **cut), params


def _ablated(llm, layer: int, head: int):
    """The parameters with head `head` of layer `layer` cut from the attention output projection (its rows of wo)."""
    cfg = llm.model_config
    params = llm.params.unfreeze()  # plain dicts and lists over the live arrays
    lp = dict(params["layers"][layer])
    wo = np.array(lp["wo"])  # [q_heads * head_dim, hidden]
    wo[head * cfg.head_dim : (head + 1) * cfg.head_dim] = 0
    lp["wo"] = wo
    params["layers"] = [lp if i == layer else p for i, p in enumerate(params["layers"])]
    return params


def _check_idle(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.pool.check_invariant()
    assert eng.pool.num_in_use == 0  # no KV block leaked
    assert not eng.runner._hooked and not eng.runner._hook_sets  # every hooked request let go of its set


def test_recording_changes_nothing_and_maps_rows_to_positions(llm):
    cfg = llm.model_config
    names = [hook_name(i, "resid_post") for i in range(cfg.num_layers)] + [hook_name(0, "attn_heads")]
    prompts = [_prompt(0), _prompt(1)]  # different lengths, batched together
    outs = llm.generate(prompts, _greedy(), use_tqdm=False, hooks=Hooks(record=names))
    for case, out in zip(REF["cases"][:2], outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert tokens == case["greedy_ids"][: len(tokens)]
        n = len(case["prompt_ids"]) + len(tokens) - 1
        acts = out.activations
        assert set(acts) == set(names)
        assert acts[names[0]].shape == (n, cfg.hidden_size)
        assert acts[hook_name(0, "attn_heads")].shape == (n, cfg.num_heads, cfg.head_dim)
        # the same positions run alone, on a scratch cache
        alone = llm.run_with_hooks(case["prompt_ids"] + tokens[:-1], Hooks(record=names))
        for name in names:
            np.testing.assert_allclose(acts[name], alone.activations[name], atol=2e-5)
        # logit lens at the last layer = the model's logits (transformers' on the prompt)
        lens = np.asarray(logit_lens(llm.params, cfg, acts[names[cfg.num_layers - 1]]))
        p = len(case["prompt_ids"])
        np.testing.assert_allclose(lens[:p], np.asarray(case["logits"]), atol=1e-4)
    _check_idle(llm)


def test_logit_lens_of_every_layer(llm):
    """The lens of layer i's residual equals the logits of the model truncated after layer i."""
    cfg = llm.model_config
    names = [hook_name(i, "resid_post") for i in range(cfg.num_layers)]
    run = llm.run_with_hooks(_prompt(0), Hooks(record=names))
    for i, name in enumerate(names):
        cut = dataclasses.replace(cfg, num_layers=i + 1)
        params = dict(llm.params)
        params["layers"] = params["layers"][: i + 1]
        expect = np.asarray(forward_dense(params, cut, np.asarray(_prompt(0), np.int32)))
        np.testing.assert_allclose(np.asarray(logit_lens(llm.params, cfg, run.activations[name])), expect, atol=1e-4)


def test_head_ablation_equals_zeroed_output_projection(llm):
    cfg = llm.model_config
    layer, head = cfg.num_layers - 1, 1
    mask = np.ones(cfg.num_heads, np.float32)
    mask[head] = 0.0
    hooks = Hooks(head_mask={layer: mask})
    ids = _prompt(0)
    hooked = llm.run_with_hooks(ids, hooks).logits
    hooked_tokens = llm.generate([ids], _greedy(), use_tqdm=False, hooks=hooks)[0].outputs[0].token_ids
    plain = llm.logits(ids)
    assert np.abs(hooked - plain).max() > 1e-2  # the head matters
    with llm.update_params(_ablated(llm, layer, head)):
        np.testing.assert_allclose(llm.logits(ids), hooked, atol=1e-5)
        assert llm.generate([ids], _greedy(), use_tqdm=False)[0].outputs[0].token_ids == hooked_tokens
    # the original weights are back, and no request reuses KV computed under the ablated ones
    np.testing.assert_allclose(llm.logits(ids), np.asarray(REF["cases"][0]["logits"]), atol=1e-4)
    out = llm.generate([ids], _greedy(24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == REF["cases"][0]["greedy_ids"]
    _check_idle(llm)


def test_update_params_drops_stale_prefix_cache(llm):
    """A prompt cached under the old weights must be recomputed under the new ones."""
    cfg = llm.model_config
    ids = _prompt(1) + _prompt(0)  # longer than a page
    llm.generate([ids], _greedy(), use_tqdm=False)  # leaves the prompt's full blocks in the prefix cache
    again = llm.generate([ids], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    layer, head = 0, 0
    mask = np.ones(cfg.num_heads, np.float32)
    mask[head] = 0.0
    expect = llm.generate([ids], _greedy(), use_tqdm=False, hooks=Hooks(head_mask={layer: mask}))[0]
    update = llm.update_params(_ablated(llm, layer, head))
    try:
        out = llm.generate([ids], _greedy(), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == expect.outputs[0].token_ids
    finally:
        update.restore()
    llm.generate([ids], _greedy(), use_tqdm=False)  # cached again under the original weights
    # weights assigned directly, bypassing update_params: the engine notices and drops the prefix cache too
    original = llm.engine.runner.params
    llm.engine.runner.params = jax.device_put(_ablated(llm, layer, head), jax.devices()[0])
    try:
        out = llm.generate([ids], _greedy(), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == expect.outputs[0].token_ids
    finally:
        llm.engine.runner.params = original
    _check_idle(llm)


def test_steering_vector_at_layer_k(llm):
    cfg = llm.model_config
    k = 0
    name = hook_name(k, "resid_post")
    ids = _prompt(0)
    vec = np.random.default_rng(0).normal(size=cfg.hidden_size).astype(np.float32)

    def steer(x, ctx):  # x: [T, hidden]
        return x + ctx.data

    plain = llm.run_with_hooks(ids, Hooks(record=[name]))
    steered = llm.run_with_hooks(ids, Hooks(edit={name: steer}, data={name: vec}, record=[name]))
    np.testing.assert_allclose(steered.activations[name], plain.activations[name] + vec, atol=1e-5)
    cut, params = _from_layer(llm, k + 1)
    expect = np.asarray(forward_dense(params, cut, plain.activations[name] + vec))
    np.testing.assert_allclose(steered.logits, expect, atol=1e-4)
    # through the engine's steps: generation follows the steered logits' argmax at the prompt's end
    out = llm.generate([ids], _greedy(1), use_tqdm=False, hooks=Hooks(edit={name: steer}, data={name: vec}))[0]
    assert out.outputs[0].token_ids == [int(np.argmax(expect[-1]))]
    # new data, same functions: no new compile, in the per-prompt forward or in the engine's steps
    with compiled_jits() as names:
        llm.run_with_hooks(ids, Hooks(edit={name: steer}, data={name: 2 * vec}, record=[name]))
        llm.generate([ids], _greedy(1), use_tqdm=False, hooks=Hooks(edit={name: steer}, data={name: 2 * vec}))
    assert names == []
    _check_idle(llm)


def test_activation_patching_between_two_prompts(llm):
    cfg = llm.model_config
    k = cfg.num_layers - 1
    name = hook_name(k, "resid_pre")
    clean = _prompt(0)
    corrupted = list(clean)
    corrupted[3] = (corrupted[3] + 7) % cfg.vocab_size
    clean_run = llm.run_with_hooks(clean, Hooks(record=[name]))
    corrupt_run = llm.run_with_hooks(corrupted, Hooks(record=[name]))
    assert np.abs(clean_run.logits - corrupt_run.logits).max() > 1e-3

    def patch(x, ctx):  # x: [rows, hidden]; ctx.data: the clean stream [T, hidden] by position, "at" [T] bool
        pos = jnp.clip(ctx.positions, 0, ctx.data["at"].shape[0] - 1)  # [rows]; padding rows are not valid
        at = ctx.valid & ctx.data["at"][pos]
        return jnp.where(at[:, None], ctx.data["stream"][pos], x)

    T = len(clean)
    stream = clean_run.activations[name]  # [T, hidden]
    every = np.ones(T, bool)
    patched = llm.run_with_hooks(corrupted, Hooks(edit={name: patch}, data={name: {"stream": stream, "at": every}}))
    np.testing.assert_allclose(patched.logits, clean_run.logits, atol=1e-5)  # every position patched: clean run
    last = np.arange(T) == T - 1
    patched = llm.run_with_hooks(corrupted, Hooks(edit={name: patch}, data={name: {"stream": stream, "at": last}}))
    stream = corrupt_run.activations[name].copy()
    stream[T - 1] = clean_run.activations[name][T - 1]
    cut, params = _from_layer(llm, k)
    np.testing.assert_allclose(patched.logits, np.asarray(forward_dense(params, cut, stream)), atol=1e-4)


def test_hooked_requests_leave_the_prefix_cache_alone(llm):
    ids = (_prompt(0) + _prompt(1))[::-1]  # longer than a page, and no other test caches it
    llm.generate([ids], _greedy(2), use_tqdm=False, hooks=Hooks(record=[hook_name(0, "resid_pre")]))
    out = llm.generate([ids], _greedy(2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check_idle(llm)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda cfg: Hooks(record=["layers.0.nope"]), "unknown hook point"),
        (lambda cfg: Hooks(record=[hook_name(cfg.num_layers, "resid_pre")]), "the model has layers"),
        (lambda cfg: Hooks(head_mask={0: np.ones(cfg.num_heads + 1)}), "head mask for layer 0 must have shape"),
        (lambda cfg: Hooks(edit={hook_name(0, "mlp_out"): lambda x, ctx: x[:, :3]}), "returned shape"),
        (lambda cfg: Hooks(data={hook_name(0, "mlp_out"): np.ones(3)}), "no edit function"),
    ],
)
def test_bad_hooks_are_clear_errors_and_the_engine_keeps_serving(llm, make, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([_prompt(0)], _greedy(2), use_tqdm=False, hooks=make(llm.model_config))
    _check_idle(llm)
    out = llm.generate([_prompt(0)], _greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == REF["cases"][0]["greedy_ids"][:4]


def test_bad_weight_updates_are_refused(llm):
    params = llm.params
    wrong_shape = params.unfreeze()
    wrong_shape["final_norm"] = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"final_norm.*expected float32"):
        llm.update_params(wrong_shape)
    with pytest.raises(ValueError, match="structure"):
        llm.update_params({"embed": params["embed"]})
    assert llm.params is params
    _check_idle(llm)
