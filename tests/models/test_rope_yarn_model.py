"""A YaRN model end to end against transformers: tests/fixtures/tiny-yarn (random Qwen3, YaRN factor 8 over 32
original positions) run through `LLM` at positions up to 5.75x the original context, one-shot and chunked prefill and
decode, under two YaRN settings (the second: unrounded ramp, other betas, an explicit attention factor)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support.checkpoints import DATA

from netra_jax import LLM, SamplingParams
from netra_jax.models.rope import attention_scaling

TINY_YARN = DATA / "tiny-yarn"
REF = json.loads((TINY_YARN / "reference.json").read_text())
CHUNK = 64  # max_num_batched_tokens: the 160-token prompt is prefilled in three steps


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=sorted(REF["variants"]))
def variant(request, tmp_path_factory):
    """The fixture's weights under one variant's rope_parameters, loaded as an LLM."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    for f in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        shutil.copy(TINY_YARN / f, path / f)
    config = json.loads((TINY_YARN / "config.json").read_text())
    config["rope_parameters"] = REF["variants"][name]["rope_parameters"]
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=CHUNK, warmup=False)
    return name, llm


def test_config_is_yarn_past_three_original_contexts(variant):
    name, llm = variant
    cfg = llm.model_config
    rc = cfg.rope_full
    assert rc.rope_type == "yarn" and attention_scaling(rc) != 1.0
    case = REF["variants"][name]["cases"][0]
    assert len(case["prompt_ids"]) > 3 * rc.original_max_position_embeddings


def test_prompt_logits_match_transformers(variant, record_property):
    name, llm = variant
    for case in REF["variants"][name]["cases"]:
        got = llm.logits(case["prompt_ids"])
        want = np.asarray(case["logits"], np.float32)
        assert got.shape == want.shape
        err = float(np.abs(got - want).max())
        record_property(f"{name}_max_logit_err", err)
        assert err < 1e-4


def test_chunked_prefill_and_decode_match_transformers(variant, record_property):
    """Prompt log-probs from the ordinary (chunked) prefill steps, then greedy decode with the log-probs of each
    chosen token: positions 0 .. 183 of a model whose original context is 32."""
    name, llm = variant
    for case in REF["variants"][name]["cases"]:
        ids, greedy = case["prompt_ids"], case["greedy_ids"]
        assert len(ids) > 2 * CHUNK
        params = SamplingParams(max_tokens=len(greedy), temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == greedy
        prompt_want = log_softmax(case["logits"])  # row i predicts token i + 1
        prompt_err = max(
            abs(out.prompt_logprobs[i + 1][ids[i + 1]].logprob - prompt_want[i, ids[i + 1]])
            for i in range(len(ids) - 1)
        )
        decode_want = log_softmax(case["greedy_logits"])
        decode_err = max(
            abs(out.outputs[0].logprobs[j][tok].logprob - decode_want[j, tok]) for j, tok in enumerate(greedy)
        )
        record_property(f"{name}_chunked_prefill_max_logprob_err", prompt_err)
        record_property(f"{name}_decode_max_logprob_err", decode_err)
        assert prompt_err < 1e-4 and decode_err < 1e-4
