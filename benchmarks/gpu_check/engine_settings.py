"""The engine settings the model and serve sections share, as `LLM` keyword arguments and as `netra-jax serve` flags:
the same settings compile the same step shapes, so the serve section's server finds the model section's
compilations in the persistent XLA cache."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

FULL = {
    "dtype": "bfloat16",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
    "max_model_len": 2048,
    "page_size": 16,
    "num_kv_pages": 8192,  # 131072 tokens, 16 GiB of bf16 K/V for the 8B shape: 256 sequences x 512 tokens
    "attention_backend": "auto",
}
# the dry run: as few step buckets and sampler batch sizes as still exercise chunked prefill and batching (the CPU
# compiles each in about a second)
DRY = FULL | {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 64}
DRY["num_kv_pages"] = 32
DRY["warmup"] = False  # compiling every bucket takes about a minute on a 2-core CPU: the dry run compiles lazily


def settings(dry: bool) -> dict:
    """The settings, with async scheduling switched on where this checkout's engine has it."""
    s = dict(DRY if dry else FULL)
    if has_async_scheduling():
        s["async_scheduling"] = True
    return s


def has_async_scheduling() -> bool:
    from netra_jax.config import EngineConfig

    return any(f.name == "async_scheduling" for f in dataclasses.fields(EngineConfig))


def llm_kwargs(dry: bool) -> dict:
    """Keyword arguments for `netra_jax.LLM` (those it does not take are left out)."""
    from netra_jax import LLM

    accepted = inspect.signature(LLM.__init__).parameters
    return {k: v for k, v in settings(dry).items() if k in accepted} | {"load_format": "dummy"}


def serve_flags(dry: bool) -> list[str]:
    """The same settings as `netra-jax serve` flags (those its parser does not know are left out)."""
    from netra_jax.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    known = parser._option_string_actions
    flags = ["--load-format", "dummy"]
    for k, v in settings(dry).items():
        flag = "--no-warmup" if k == "warmup" else "--" + k.replace("_", "-")
        if flag not in known or v is False and flag != "--no-warmup" or k == "warmup" and v:
            continue
        flags += [flag] if isinstance(v, bool) else [flag, str(v)]
    return flags
