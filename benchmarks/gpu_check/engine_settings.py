"""The engine settings of the GPU check's serving model, shared by the serve, model and quant sections, the compile
check and the bundles of compiled programs carried to the device: up to 512 sequences, 8192 tokens a step (vLLM's and
SGLang's default on these GPUs), a context of the long sweep's 8192 prompt tokens plus its 256 output tokens, and the
KV cache sized from the device (`sizing`: what the engine sizes on that GPU, `netra_jax.engine.aot.target_pages`), so
that a bundle compiled for the device without it holds the very programs the engine calls there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

FULL = {
    "dtype": "bfloat16",
    "max_num_seqs": 512,
    "max_num_batched_tokens": 8192,
    "max_model_len": 8192 + 256,
    "page_size": 16,
    "attention_backend": "auto",
    "async_scheduling": True,
}
# the dry run: as few step buckets and sampler batch sizes as still exercise chunked prefill and batching (the CPU
# compiles each in about a second), and a fixed KV cache
DRY = FULL | {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 64}
DRY_PAGES = 32
# the GPU compile check's KV cache for every listed model (a bundle and the device run size it from the device):
# 131072 tokens, 16 GiB of bf16 K/V for the 8B shape
COMPILE_CHECK_PAGES = 8192


def settings(dry: bool) -> dict:
    return dict(DRY if dry else FULL)


def engine_config(model: str | Path, dry: bool, **options):
    """The EngineConfig of these settings over `model` (random weights: load_format "dummy"), with `options` (EngineArgs
    fields: quantization, num_kv_pages, enable_lora, ...) on top."""
    from netra_jax.engine_args import EngineArgs

    return EngineArgs(model=str(model), load_format="dummy", **settings(dry), **options).create_engine_config()


def sizing(model: str | Path, target: str | None, dry: bool, quantization: str | None = None) -> dict:
    """How the engine is sized on `target` ("h100", "h200", ...: `netra_jax.targets`; None: a device the check does
    not describe, sized by the engine itself): the settings, the KV pages and what they hold, the weights' bytes."""
    out = {"target": target, **settings(dry)}
    if dry:
        return out | {"num_kv_pages": DRY_PAGES}
    if target is None:
        return out | {"num_kv_pages": None}
    import jax

    from netra_jax.engine.aot import target_pages
    from netra_jax.loader import abstract_params
    from netra_jax.ops.kv_quant import storage_dtype
    from netra_jax.quant import quantize_params

    config = engine_config(model, dry, quantization=quantization)
    cfg, params = abstract_params(str(model), config.dtype)
    if quantization:
        params = jax.eval_shape(lambda p: quantize_params(p, quantization), params)
    kv_dtype = storage_dtype(config.kv_cache_dtype, params["embed"].dtype)
    pages = target_pages(config, cfg, params, kv_dtype, target)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
    return out | {
        "num_kv_pages": pages,
        "kv_tokens": pages * config.cache.page_size,
        "kv_gib": round(pages * config.cache.page_size * kv_token / 2**30, 2),
        "weights_gib": round(weights / 2**30, 2),
        "gpu_memory_utilization": config.cache.gpu_memory_utilization,
    }


def _options(size: dict) -> dict:
    return {k: v for k, v in size.items() if k in FULL or (k == "num_kv_pages" and v is not None)}


def llm_kwargs(size: dict, compiled: str | None = None) -> dict:
    """Keyword arguments for `netra_jax.LLM` of a `sizing`; `compiled`: a bundle to load (else compiled on use)."""
    return _options(size) | {"load_format": "dummy", "warmup": False, "compiled": compiled}


def serve_flags(size: dict, warmup: bool, compiled: str | None = None, quantization: str | None = None) -> list[str]:
    """The same settings as `netra-jax serve` flags; `warmup`: let the server compile every program it did not load
    before /ready answers (`--warmup full`: nothing compiles in the background of a sweep)."""
    flags = ["--warmup", "full"] if warmup else ["--no-warmup"]
    flags += ["--compiled", compiled] if compiled else []
    return flags + compile_flags(size, quantization)


def compile_flags(size: dict, quantization: str | None = None) -> list[str]:
    """The engine's flags of a `sizing`, as `netra-jax compile` takes them (the bundle the device run loads)."""
    flags = ["--load-format", "dummy"]
    flags += ["--quantization", quantization] if quantization else []
    for k, v in _options(size).items():
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, str(v)]
    return flags


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of the serving model the device run serves: bf16 weights, or quantized at load."""

    name: str  # "bf16" | "fp8"
    quantization: str | None


VARIANTS = (Variant("bf16", None), Variant("fp8", "fp8"))
