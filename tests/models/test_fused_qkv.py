"""`fuse_qkv` (netra_jax/models/transformer.py): each layer's q, k and v projections joined into one weight, the
engine's CPU layout. The fused forward must give the unfused one's logits (same products, split after) on every
family's fixture (biases: Qwen2; q/k norms: Qwen3; Gemma 3's sandwich norms) and against transformers' logits, and
leave quantized projections as they are."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, TINY_MODELS, reference

from netra_jax import LLM, SamplingParams
from netra_jax.loader import load_model
from netra_jax.models.transformer import forward_dense, fuse_qkv


@pytest.mark.parametrize("name", TINY_MODELS)
def test_fused_projections_give_the_same_logits(name):
    cfg, params = load_model(FIXTURES / name, "float32", cache=False)
    fused = fuse_qkv(params)
    lp, fp = params["layers"][0], fused["layers"][0]
    assert {"wq", "wk", "wv", "bq", "bk", "bv"}.isdisjoint(fp) and fp["wqkv"].shape == (
        cfg.hidden_size,
        cfg.q_size + 2 * cfg.kv_size,
    )
    assert ("bqkv" in fp) == ("bq" in lp)
    case = reference(name)["cases"][0]
    ids = jnp.asarray(case["prompt_ids"])
    a, b = np.asarray(forward_dense(params, cfg, ids)), np.asarray(forward_dense(fused, cfg, ids))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))
    np.testing.assert_allclose(b, case["logits"], rtol=0, atol=2e-4 * np.abs(case["logits"]).max())


def test_quantized_projections_and_partial_biases_are_left_alone():
    cfg, params = load_model(FIXTURES / "tiny-qwen2", "float32", cache=False)
    partial = {**params, "layers": [{k: v for k, v in lp.items() if k != "bk"} for lp in params["layers"]]}
    assert all("wqkv" not in lp and "wq" in lp for lp in fuse_qkv(partial)["layers"])
    q = LLM(FIXTURES / "tiny-qwen2", dtype="float32", quantization="int8", warmup=False, max_num_seqs=2)
    assert all("wq" in lp and "wqkv" not in lp for lp in q.engine.runner.params["layers"])


def test_the_cpu_engine_runs_fused_and_keeps_greedy_tokens():
    name = "tiny-qwen2"
    case = reference(name)["cases"][0]
    llm = LLM(FIXTURES / name, dtype="float32", warmup=False, max_num_seqs=2)
    assert all("wqkv" in lp and "bqkv" in lp for lp in llm.engine.runner.params["layers"])
    out = llm.generate(
        [{"prompt_token_ids": case["prompt_ids"]}],
        SamplingParams(max_tokens=len(case["greedy_ids"]), temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert list(out[0].outputs[0].token_ids) == case["greedy_ids"]


def test_update_params_takes_the_loaders_layout_on_a_fused_engine():
    """Weights as `load_model` gives them (q, k and v apart) update a CPU engine that holds them joined: joined on
    the way in, so the engine answers as it did with its own copy."""
    name = "tiny-llama"
    case = reference(name)["cases"][0]
    llm = LLM(FIXTURES / name, dtype="float32", warmup=False, max_num_seqs=2)
    _, loaded = load_model(FIXTURES / name, "float32", cache=False)
    previous = llm.params
    with llm.update_params(loaded):
        assert llm.params is not previous and "wqkv" in llm.params["layers"][0]
        out = llm.generate(
            [{"prompt_token_ids": case["prompt_ids"]}],
            SamplingParams(max_tokens=len(case["greedy_ids"]), temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        assert list(out[0].outputs[0].token_ids) == case["greedy_ids"]
    np.testing.assert_array_equal(llm.params["layers"][0]["wqkv"], previous["layers"][0]["wqkv"])  # restored
