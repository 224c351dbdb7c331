"""The trainer-facing side of `LLM`: sleep / wake_up (the KV cache's device arrays deleted, the weights moved to the
host, generation the same afterwards, requests refused meanwhile), `update_params` referencing a trainer's arrays
without copies, and `LLM.params` as a read-only view whose mapped trees update_params takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, SamplingParams
from netra_jax.loader import load_model
from netra_jax.models.frozen_params import FrozenLayers, FrozenParams

MODEL = FIXTURES / "tiny-llama"
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, logprobs=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)


def _prompt() -> list[int]:
    return reference("tiny-llama")["cases"][0]["prompt_ids"] * 3  # several pages: a prefix-cache hit when repeated


def _run(llm, params=SAMPLED):
    out = llm.generate({"prompt_token_ids": _prompt()}, params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].raw_logprobs, out.num_cached_tokens


def test_sleep_level_1_frees_the_kv_cache_and_wakes_up_the_same(llm):
    tokens, lps, _ = _run(llm)
    assert _run(llm)[2] > 0  # the prompt is in the prefix cache
    pages = jax.tree.leaves(llm.engine.runner.kv)
    llm.sleep(level=1)
    assert llm.is_sleeping() and llm.engine.runner.kv is None
    assert all(a.is_deleted() for a in pages)
    with pytest.raises(RuntimeError, match="asleep.*wake_up"):
        llm.generate({"prompt_token_ids": _prompt()}, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.logits(_prompt())
    assert not llm.engine.has_unfinished_requests()  # the refused request left nothing behind
    llm.wake_up()
    assert not llm.is_sleeping()
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(llm.engine.runner.kv))  # zeroed
    again, again_lps, cached = _run(llm)
    assert cached == 0  # the prefix cache went with the KV
    assert again == tokens and again_lps == lps


def test_sleep_level_2_moves_the_weights_to_the_host(llm):
    tokens, lps, _ = _run(llm)
    live = llm.engine.runner.params
    llm.sleep(level=2)
    assert llm.engine.runner.params is None and llm.engine.runner.kv is None
    host = llm.params  # the host copy, still readable
    assert isinstance(host["embed"], np.ndarray)
    np.testing.assert_array_equal(host["embed"], np.asarray(live["embed"]))
    del live
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate({"prompt_token_ids": _prompt()}, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # vLLM's order: weights first (to update them), then the KV cache
    assert llm.is_sleeping() and llm.engine.runner.kv is None
    assert isinstance(llm.params["embed"], jax.Array)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _run(llm)[:2] == (tokens, lps)


def test_update_params_while_asleep_wakes_the_weights(llm):
    tokens = _run(llm, GREEDY)[0]
    new = jax.tree.map(lambda a: a, llm.params)  # what a trainer hands back: a tree mapped over the view
    llm.sleep(level=2)
    llm.update_params(new)
    assert llm.is_sleeping() and llm.engine.runner.params["embed"] is new["embed"]
    llm.wake_up()
    assert _run(llm, GREEDY)[0] == tokens


def test_sleep_refuses_bad_calls(llm):
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(tags=["everything"])
    llm.engine.add_request("busy", {"prompt_token_ids": _prompt()}, GREEDY)
    try:
        with pytest.raises(RuntimeError, match="requests are running"):
            llm.sleep()
    finally:
        llm.engine.abort_request("busy")
        llm.engine.settle()
    llm.wake_up()  # awake already: nothing to do
    assert not llm.is_sleeping()


def test_params_is_a_read_only_view(llm):
    view = llm.params
    assert isinstance(view, FrozenParams) and isinstance(view["layers"], FrozenLayers)
    assert llm.params is view  # the same view while the weights do not change
    with pytest.raises(TypeError, match="read-only.*update_params"):
        view["final_norm"] = np.ones(3, np.float32)
    with pytest.raises(TypeError, match="update_params"):
        view["layers"][0]["wo"] = 0
    with pytest.raises(TypeError, match="update_params"):
        view["layers"][0] = {}
    mapped = jax.tree.map(lambda a: a, view)
    assert isinstance(mapped, FrozenParams)
    plain = view.unfreeze()
    assert type(plain) is dict and type(plain["layers"]) is list and plain["embed"] is view["embed"]
    grads = jax.grad(lambda p: jnp.sum(p["final_norm"] ** 2))(view)  # differentiable as it is
    assert isinstance(grads, FrozenParams)


def test_update_params_references_the_callers_arrays(llm):
    tokens = _run(llm, GREEDY)[0]
    new = jax.tree.map(lambda a: a * 1, llm.params)  # fresh arrays in the engine's dtype, on its device
    with llm.update_params(new):
        live = llm.engine.runner.params
        for (_, a), (_, b) in zip(jax.tree.flatten_with_path(live)[0], jax.tree.flatten_with_path(new)[0], strict=True):
            assert a is b  # referenced, not copied
        assert _run(llm, GREEDY)[0] == tokens
    # the loader's layout (q, k and v apart): only the joined projection is a new array
    _, loaded = load_model(MODEL, "float32", cache=False)
    loaded = jax.device_put(loaded, jax.devices()[0])
    with llm.update_params(loaded):
        live = llm.engine.runner.params
        assert live["embed"] is loaded["embed"] and live["layers"][0]["wo"] is loaded["layers"][0]["wo"]
        assert "wqkv" in live["layers"][0] and "wq" not in live["layers"][0]
        assert _run(llm, GREEDY)[0] == tokens


def test_update_params_casts_float_weights_to_the_engines_dtype():
    llm = LLM(MODEL, dtype="bfloat16", max_num_seqs=2)
    tokens = llm.generate({"prompt_token_ids": _prompt()}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    master = jax.tree.map(lambda a: a.astype(jnp.float32), llm.params)  # a trainer's float32 master weights
    llm.update_params(master)
    assert llm.params["embed"].dtype == jnp.bfloat16 and llm.params["final_norm"].dtype == jnp.float32
    assert llm.generate({"prompt_token_ids": _prompt()}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens
    with pytest.raises(ValueError, match="expected"):
        llm.update_params(jax.tree.map(lambda a: np.zeros(a.shape, np.int32), llm.params))
