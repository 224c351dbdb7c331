"""The LLM class's vLLM-compatible surface on a tiny fixture: every option checked at construction, the lazy default
(nothing compiled before the first call, and then only the token buckets the calls reach), trust_remote_code,
tokenizer=, max_logprobs, enforce_eager, reset_prefix_cache, the CLI's matching flags and the package's exports."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.compiles import compiled_jits, recorded_shapes

import netra_jax
from netra_jax import LLM, SamplingParams
from netra_jax.config import ConfigError
from netra_jax.engine_args import CLIError, add_engine_args, engine_config
from netra_jax.engine_config import CacheConfig, EngineConfig, SchedulerConfig

MODEL = FIXTURES / "tiny-llama"
SMALL = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, **SMALL)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"attention_backend": "flash_attn"}, "attention_backend must be one of"),
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"task": "classify"}, "task must be one of"),
        ({"load_format": "pt"}, "load_format must be one of"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
        ({"quantization": "awq"}, "quantization must be None or one of int8"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_model_len": -5}, "max_model_len must be a positive integer"),
        ({"max_model_len": 513}, "max_model_len=513 is longer than the model's context of 512"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be a fraction in \(0, 1\]"),
        ({"max_logprobs": 21}, r"max_logprobs must be an integer in \[0, 20\]"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "pooler_config applies to task 'embed'"),
        ({"warmup": True, "enforce_eager": True}, "enforce_eager=True compiles nothing ahead of time"),
    ],
)
def test_bad_options_fail_at_construction_before_loading(kw, match, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("weights were read before the options were checked")

    monkeypatch.setattr("netra_jax.engine.factory.load_model", no_loading)
    with pytest.raises(ValueError, match=match):
        LLM(MODEL, **kw)


def test_gpu_kernel_off_gpu_fails_before_loading(monkeypatch):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("the kernel runs here")
    monkeypatch.setattr("netra_jax.engine.factory.load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError, match="'triton' needs a GPU"):
        LLM(MODEL, attention_backend="triton")


def test_config_objects_check_themselves():
    with pytest.raises(ConfigError, match="num_kv_pages must be an integer >= 2"):
        CacheConfig(num_pages=1)
    with pytest.raises(ConfigError, match="max_waiting"):
        SchedulerConfig(max_waiting=0)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig().warmup is True  # the server's default: compile everything before ready


def test_lazy_by_default_and_compiles_only_the_buckets_reached(llm):
    """LLM() compiles nothing; prompts of many lengths then compile one step per token bucket they reach (never one
    per prompt length), each a shape the warm-up would compile, and a second round of other lengths in the same
    buckets compiles no step at all."""
    eng = llm.engine
    assert not eng.config.warmup and eng.warmup_report is None
    runner = eng.runner
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    with recorded_shapes(runner) as used:
        with compiled_jits() as first:
            for n in (3, 5, 9, 14, 20, 27, 33, 41):  # one at a time: each prefill is a step of n tokens
                llm.generate([rng.integers(3, vocab, n).tolist()], GREEDY, use_tqdm=False)
        with compiled_jits() as second:
            for n in (4, 6, 11, 13, 22, 30, 36, 39):  # the same buckets, other lengths
                llm.generate([rng.integers(3, vocab, n).tolist()], GREEDY, use_tqdm=False)
    steps = [n for n in first if n == "_step"]
    assert set(used) <= set(runner.all_shapes())
    assert len(steps) == len(set(used)) < 8  # 8 prompt lengths (and their decodes) in fewer buckets
    assert [n for n in second if n == "_step"] == []


def test_max_logprobs():
    llm = LLM(MODEL, max_logprobs=2, enforce_eager=True, **SMALL)
    assert llm.engine.warmup_report is None  # enforce_eager: nothing compiled ahead of time
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 2
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most the engine's max_logprobs of 2"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{field: 3}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def _remote(tmp_path, name: str, **changes):
    d = tmp_path / name
    shutil.copytree(FIXTURES / "tiny-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}, **changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_trust_remote_code(tmp_path, llm):
    native = _remote(tmp_path, "native")
    with pytest.raises(ValueError, match="pass trust_remote_code=True"):
        LLM(native, **SMALL)
    trusted = LLM(native, trust_remote_code=True, **SMALL)  # the native Llama, the auto_map ignored
    ids = reference("tiny-llama")["cases"][1]["prompt_ids"]
    np.testing.assert_array_equal(trusted.logits(ids), llm.logits(ids))
    custom = _remote(tmp_path, "custom", architectures=["CustomForCausalLM"])
    for trust in (False, True):
        with pytest.raises(ValueError, match="never runs remote code, with or without trust_remote_code"):
            LLM(custom, trust_remote_code=trust, **SMALL)


def test_other_tokenizer(tmp_path, smollm2_path):
    other = tmp_path / "tok"
    other.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny-qwen2" / f, other / f)
    llm = LLM(MODEL, tokenizer=other / "tokenizer.json", **SMALL)
    chat = reference("tiny-llama")["chat"]
    assert llm.get_tokenizer().encode(chat["prompt_text"], add_special_tokens=False) == chat["prompt_ids"]
    with pytest.raises(ValueError, match="more than the model's vocabulary of 512"):
        LLM(MODEL, tokenizer=smollm2_path, **SMALL)
    with pytest.raises(FileNotFoundError, match="tokenizer path"):
        LLM(MODEL, tokenizer=tmp_path / "missing", **SMALL)


def test_reset_prefix_cache(llm):
    eng, pool = llm.engine, llm.engine.pool
    prompt = list(range(3, 3 + 40))  # two full pages of 16 and a partial one
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert pool.num_cached >= 2
    hits = pool.prefix_hits_tokens
    again = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert pool.prefix_hits_tokens == hits + 32
    # while a request runs: refused, nothing changes
    eng.add_request("running", {"prompt_token_ids": prompt}, GREEDY)
    eng.step()
    cached = pool.num_cached
    assert llm.reset_prefix_cache() is False
    assert pool.num_cached == cached and pool.num_in_use > 0
    while eng.has_unfinished_requests():
        eng.step()
    # idle: every cached page is free again, none leaked, and the next run computes the prompt anew
    assert llm.reset_prefix_cache() is True
    pool.check_invariant()
    assert pool.num_cached == 0 and pool.num_in_use == 0 and pool.num_free == pool.num_total
    hits = pool.prefix_hits_tokens
    fresh = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert pool.prefix_hits_tokens == hits
    assert fresh[0].outputs[0].token_ids == again[0].outputs[0].token_ids


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(
        p.parse_args(["m", "--tokenizer", "t", "--trust-remote-code", "--enforce-eager", "--max-logprobs", "5"])
    )
    assert (cfg.tokenizer, cfg.trust_remote_code, cfg.warmup, cfg.max_logprobs) == ("t", True, False, 5)
    assert engine_config(p.parse_args(["m"])).warmup is True  # serve compiles everything before ready
    with pytest.raises(CLIError, match="attention_backend must be one of"):
        engine_config(p.parse_args(["m", "--attention-backend", "flash"]))


def test_public_names_are_exported():
    for name in netra_jax.__all__:
        assert getattr(netra_jax, name) is not None
    from netra_jax.sampling_params import StructuredOutputsParams

    assert netra_jax.StructuredOutputsParams is StructuredOutputsParams
    assert {"TextPrompt", "TokensPrompt", "PromptType", "PoolerConfig", "paged"} <= set(netra_jax.__all__)
    prompt = netra_jax.TokensPrompt(prompt_token_ids=[5, 6, 7])
    assert prompt == {"prompt_token_ids": [5, 6, 7]}
