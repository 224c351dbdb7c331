"""One way to build an engine: `EngineArgs` holds every option once, with its default, and the three ways in (`LLM`,
the command line's engine flags, Ray Serve's application arguments) turn the same values into the same EngineConfig:
checked for every option, at the defaults and at a non-default value of each."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
from support.checkpoints import FIXTURES

import netra_jax.api
from netra_jax import LLM
from netra_jax.engine_args import EngineArgs, add_engine_args, engine_args, engine_config

MODEL = str(FIXTURES / "tiny-llama")
NAMES = [f.name for f in dataclasses.fields(EngineArgs)]

# a value other than the default for every option (warmup and enforce_eager apart: see their own test), valid together
OTHER = dict(
    model=MODEL,
    tokenizer=MODEL,
    trust_remote_code=True,
    dtype="float32",
    kv_cache_dtype="int8",
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_waiting=10,
    scheduling_policy="priority",
    align_chunks_to_buckets=False,
    page_size=8,
    compiled="/tmp/netra-jax-bundle",
    num_kv_pages=100,
    kv_cache_memory=1 << 20,
    gpu_memory_utilization=0.5,
    enable_prefix_caching=False,
    attention_backend="reference",
    tensor_parallel_size=2,
    matmul_backend="xla",
    quantization="int8",
    seed=7,
    served_model_name="served",
    compilation_cache_dir="/tmp/netra-jax-xla",
    load_format="dummy",
    task="generate",
    async_scheduling=False,
    speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    max_logprobs=5,
)
CLI_FLAGS = [  # OTHER as command-line flags
    MODEL,
    "--tokenizer", MODEL,
    "--trust-remote-code",
    "--dtype", "float32",
    "--kv-cache-dtype", "int8",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "256",
    "--max-waiting", "10",
    "--scheduling-policy", "priority",
    "--no-align-chunks-to-buckets",
    "--page-size", "8",
    "--compiled", "/tmp/netra-jax-bundle",
    "--num-kv-pages", "100",
    "--kv-cache-memory", str(1 << 20),
    "--gpu-memory-utilization", "0.5",
    "--no-enable-prefix-caching",
    "--attention-backend", "reference",
    "--tensor-parallel-size", "2",
    "--matmul-backend", "xla",
    "--quantization", "int8",
    "--seed", "7",
    "--served-model-name", "served",
    "--compilation-cache-dir", "/tmp/netra-jax-xla",
    "--load-format", "dummy",
    "--task", "generate",
    "--no-async-scheduling",
    "--speculative-config", OTHER["speculative_config"],
    "--max-logprobs", "5",
]  # fmt: skip


# the LoRA options, non-default (they need one device and no speculation, unlike OTHER)
LORA = dict(model=MODEL, enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5)
LORA_FLAGS = [MODEL, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--max-cpu-loras", "5"]
# batch_invariant picks the kernels itself (it needs the backends at "auto", one device, no LoRA)
INVARIANT = dict(model=MODEL, batch_invariant=True)
INVARIANT_FLAGS = [MODEL, "--batch-invariant"]


def _cli(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


class _Built(Exception):
    pass


def _llm_config(monkeypatch, **kw):
    """The EngineConfig `LLM(**kw)` builds its engine from (the build itself stopped)."""
    seen = {}

    def build(config):
        seen["config"] = config
        raise _Built

    monkeypatch.setattr(netra_jax.api, "build_engine", build)
    with pytest.raises(_Built):
        LLM(**kw)
    return seen["config"]


def test_every_option_has_one_default_everywhere():
    assert set(OTHER) | set(LORA) | set(INVARIANT) | {"warmup", "enforce_eager", "pooler_config"} == set(
        NAMES
    )  # the table covers every option
    assert engine_args(_cli([])) == EngineArgs()  # the flags' defaults are EngineArgs'
    explicit = inspect.signature(LLM.__init__).parameters
    for name in NAMES:  # LLM takes every option, explicitly (with EngineArgs' default) or through **engine_options
        if name in explicit:
            expected = False if name == "warmup" else EngineArgs.__dataclass_fields__[name].default
            assert explicit[name].default == expected, name
    assert "engine_options" in explicit


def test_the_three_ways_in_build_the_same_config_from_the_same_values(monkeypatch):
    reference = EngineArgs(**OTHER, warmup=False).create_engine_config()
    cli = engine_config(_cli([*CLI_FLAGS, "--no-warmup"]))
    ray = EngineArgs.from_strings({k: str(v) for k, v in {**OTHER, "warmup": False}.items()}).create_engine_config()
    llm = _llm_config(monkeypatch, **OTHER, warmup=False)
    assert cli == reference and ray == reference and llm == reference
    for name, value in OTHER.items():  # and every value arrived (none was dropped on the way)
        assert getattr(engine_args(_cli(CLI_FLAGS)), name) == value, name


def test_batch_invariant_options_agree(monkeypatch):
    reference = EngineArgs(**INVARIANT).create_engine_config()
    assert (reference.attention_backend, reference.matmul_backend) == ("cpu_invariant", "cpu_invariant")
    assert engine_config(_cli(INVARIANT_FLAGS)) == reference
    assert EngineArgs.from_strings({k: str(v) for k, v in INVARIANT.items()}).create_engine_config() == reference
    assert _llm_config(monkeypatch, **INVARIANT) == dataclasses.replace(reference, warmup=False)
    with pytest.raises(ValueError, match="attention_backend='reference' conflicts"):
        EngineArgs(**INVARIANT, attention_backend="reference").create_engine_config()


def test_lora_options_agree(monkeypatch):
    reference = EngineArgs(**LORA).create_engine_config()
    assert (reference.lora.max_loras, reference.lora.max_lora_rank, reference.lora.cpu_loras) == (3, 8, 5)
    assert engine_config(_cli(LORA_FLAGS)) == reference
    assert EngineArgs.from_strings({k: str(v) for k, v in LORA.items()}).create_engine_config() == reference
    assert _llm_config(monkeypatch, **LORA) == dataclasses.replace(reference, warmup=False)
    assert EngineArgs(max_loras=3).create_engine_config().lora is None  # without enable_lora: no adapters
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be >= max_loras \(3\)"):
        EngineArgs(**{**LORA, "max_cpu_loras": 2}).create_engine_config()
    assert EngineArgs(**LORA, tensor_parallel_size=2).create_engine_config().lora == reference.lora
    with pytest.raises(ValueError, match="LoRA adapters are served with task 'generate' without speculative"):
        EngineArgs(**LORA, task="embed").create_engine_config()


def test_embedding_options_and_defaults_agree(monkeypatch):
    pooler = '{"pooling_type": "MEAN", "normalize": false}'
    reference = EngineArgs(model=MODEL, task="embed", pooler_config=pooler).create_engine_config()
    assert engine_config(_cli([MODEL, "--task", "embed", "--pooler-config", pooler])) == reference
    assert EngineArgs.from_strings(
        {"model": MODEL, "task": "embed", "pooler_config": pooler}
    ).create_engine_config() == (reference)
    llm = _llm_config(monkeypatch, model=MODEL, task="embed", pooler_config=pooler)
    assert llm == dataclasses.replace(reference, warmup=False)  # LLM's one different default
    assert reference.warmup is True


def test_warmup_and_enforce_eager():
    assert EngineArgs().create_engine_config().warmup is True
    assert EngineArgs(enforce_eager=True).create_engine_config().warmup is False
    assert engine_config(_cli(["--enforce-eager"])).warmup is False
    assert engine_config(_cli(["--no-warmup"])).warmup is False
    with pytest.raises(ValueError, match="enforce_eager=True compiles nothing ahead of time"):
        EngineArgs(enforce_eager=True, warmup=True).create_engine_config()
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineArgs(enforce_eager="yes").create_engine_config()


def test_options_as_text_are_typed_and_unknown_ones_named():
    args = EngineArgs.from_strings(
        {"max_num_seqs": "8", "enable_prefix_caching": "false", "gpu_memory_utilization": "0.5", "dtype": ""}
    )
    assert (args.max_num_seqs, args.enable_prefix_caching, args.gpu_memory_utilization) == (8, False, 0.5)
    assert args.dtype == EngineArgs().dtype  # "": the default
    with pytest.raises(ValueError, match=r"unknown engine options \['max_num_seq'\]"):
        EngineArgs.from_strings({"max_num_seq": "8"})
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(MODEL, max_num_seq=8)
