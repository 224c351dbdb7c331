"""The engine settings the model and serve sections share, as `LLM` keyword arguments and as `netra-jax serve` flags:
the same settings compile the same step shapes, so the serve section's server finds the model section's
compilations in the persistent XLA cache. The model section builds without warm-up and warms up itself, shape by
shape under a time cap (`model.warm_up`); the server warms up only when that finished (then from the cache)."""

from __future__ import annotations

FULL = {
    "dtype": "bfloat16",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
    "max_model_len": 2048,
    "page_size": 16,
    "num_kv_pages": 8192,  # 131072 tokens, 16 GiB of bf16 K/V for the 8B shape: 256 sequences x 512 tokens
    "attention_backend": "auto",
    "async_scheduling": True,
}
# the dry run: as few step buckets and sampler batch sizes as still exercise chunked prefill and batching (the CPU
# compiles each in about a second)
DRY = FULL | {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 64}
DRY["num_kv_pages"] = 32


def settings(dry: bool) -> dict:
    return dict(DRY if dry else FULL)


def llm_kwargs(dry: bool) -> dict:
    """Keyword arguments for `netra_jax.LLM`."""
    return settings(dry) | {"load_format": "dummy", "warmup": False}


def serve_flags(dry: bool, warmup: bool) -> list[str]:
    """The same settings as `netra-jax serve` flags; `warmup`: let the server compile every step variant before
    /ready answers."""
    flags = ["--load-format", "dummy"] + ([] if warmup else ["--no-warmup"])
    for k, v in settings(dry).items():
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, str(v)]
    return flags
