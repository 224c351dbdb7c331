"""Ahead-of-time compilation (`netra-jax compile`): every program an engine of one configuration calls, compiled for a
target machine and written as a bundle (`engine.bundle`) that `--compiled` / `LLM(compiled=...)` loads.

Target "cpu" builds the engine here (its weights loaded) and compiles for this host. A GPU target (`netra_jax.targets`:
"h100", "h200", "a100") needs no GPU: a runner built for the target's compile-only device, over the parameters'
shapes alone (`loader.abstract_params`), lowers the same programs the engine would on that GPU, with the attention and
matmul backends "auto" picks there and the KV cache sized from the target's memory as the engine sizes it
(`target_pages`). Caveats of a GPU bundle: XLA cannot autotune its GEMMs without the device (it keeps its default
configurations), and the target description must match the device's driver and runtime (`netra_jax/targets`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import jax

from netra_jax.config import ConfigError, ModelConfig
from netra_jax.engine import bundle
from netra_jax.engine.engine import runner_options
from netra_jax.engine.factory import build_engine, resolve_model_path
from netra_jax.engine.runner import ModelRunner, kv_budget, max_useful_pages, num_pages_for
from netra_jax.engine.warmup import engine_variants
from netra_jax.engine_config import EngineConfig
from netra_jax.loader import abstract_params
from netra_jax.ops.attention import auto_backend
from netra_jax.ops.kv_quant import storage_dtype
from netra_jax.quant import quantize_params, weight_layout
from netra_jax.targets import GPU_TARGETS, TARGETS, compile_device

__all__ = ["DEVICELESS_OPTIONS", "compile_bundle", "compile_only_runner", "target_options", "target_pages"]

log = logging.getLogger(__name__)

# XLA options of a compile for a GPU target without the GPU. XLA rewrites a large sort (the sampler's top-k / top-p
# over a 128k vocabulary at one row, prompt logprobs' ranks) into a CUB radix sort, whose scratch size it asks the
# CUDA runtime for: with no device that fails ("invalid device ordinal"), so those sorts stay XLA's own.
DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def target_pages(config: EngineConfig, cfg: ModelConfig, params, kv_dtype, target: str) -> int:
    """KV pages for `target`: the configuration's own count or byte budget, else what the engine sizes on that GPU
    (`gpu_memory_utilization` of its memory, less the weights, `runner.kv_budget` of the rest), capped at what
    max_num_seqs sequences of max_model_len tokens can use."""
    usable = GPU_TARGETS[target].device_memory * config.cache.gpu_memory_utilization
    max_len = config.max_model_len or cfg.max_context
    useful = max_useful_pages(config.scheduler.max_num_seqs, max_len, config.cache.page_size)
    memory = (usable, _nbytes(params))
    pages = num_pages_for(cfg, config.cache, kv_dtype, config.cache.page_size, useful, memory=memory)
    if kv_budget(*memory) <= 0:
        raise ConfigError(f"the weights ({memory[1] / 2**30:.1f} GiB) leave no memory for a KV cache on {target}")
    return pages


def target_options(config: EngineConfig, cfg: ModelConfig, dtype, kv_dtype, target: str) -> dict:
    """The runner options of `config` (`engine.runner_options`) with its backends as they resolve on `target`'s GPU
    rather than on this host: the matmul backend for the target's compute capability, attention's "auto" as the
    kernel it runs there (`ops.attention.auto_backend`) for weights of `dtype` and a KV cache of `kv_dtype`."""
    gpu = GPU_TARGETS[target]
    opts = runner_options(config, cfg, kv_dtype, platform="gpu")
    opts["matmul_backend"] = config.resolved_matmul_backend("gpu", gpu.compute_capability)
    if opts["backend"] == "auto":
        opts["backend"] = auto_backend(
            "gpu",
            gpu.compute_capability,
            dtype=dtype,
            kv_dtype=kv_dtype,
            q_heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=config.cache.page_size,
        )
    return opts


def compile_only_runner(config: EngineConfig, target: str) -> tuple[ModelRunner, int]:
    """(a runner for `target`'s compile-only device, the vocabulary size): the parameters abstract, laid out as the
    engine lays them out on that GPU (quantized at load by `config.quantization`, re-laid for the matmul backend),
    nothing allocated. ConfigError for what a GPU target does not compile yet."""
    if target not in GPU_TARGETS:
        raise ConfigError(f"{target!r} is not a GPU target; known: {', '.join(GPU_TARGETS)}")
    for name, unsupported in (
        ("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
        ("speculative decoding", config.speculative is not None),
        ("task 'embed'", config.task != "generate"),
    ):
        if unsupported:
            raise ConfigError(f"compiling for a GPU target does not support {name} yet")
    gpu = GPU_TARGETS[target]
    path = resolve_model_path(config.model)
    cfg, params = abstract_params(path, config.dtype, trust_remote_code=config.trust_remote_code)
    config.check_model(cfg)
    matmul = config.resolved_matmul_backend("gpu", gpu.compute_capability)
    if config.quantization:
        params = jax.eval_shape(lambda p: quantize_params(p, config.quantization), params)
    params = jax.eval_shape(lambda p: weight_layout(p, matmul), params)
    kv_dtype = storage_dtype(config.kv_cache_dtype, params["embed"].dtype)
    opts = target_options(config, cfg, params["embed"].dtype, kv_dtype, target)
    pages = target_pages(config, cfg, params, kv_dtype, target)
    runner = ModelRunner(cfg, params, num_pages=pages, compile_for=compile_device(target), **opts)
    runner.set_prompt_logprob_buckets(fine=False)  # the warm-up's set, which a bundle holds
    return runner, cfg.vocab_size


def compile_bundle(
    config: EngineConfig,
    target: str,
    out_dir: str | Path,
    *,
    workers: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Compile every program an engine of `config` calls (`engine.warmup.engine_variants`) for `target` and write
    them with their signature to `out_dir`; returns the manifest. Target "cpu" compiles for this host (a CPU
    backend); a GPU target compiles without a GPU (jax's CUDA plugin must be importable)."""
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if jax.config.jax_compilation_cache_dir:
        raise ConfigError(
            "compile in a process without jax's persistent compilation cache (an executable read back from it does not "
            "serialize whole): `netra-jax compile` runs without one"
        )
    config = dataclasses.replace(config, warmup=False, compiled=None, compilation_cache_dir="")
    if target == "cpu":
        if jax.default_backend() != "cpu":
            raise ConfigError(f"target 'cpu' compiles on a CPU backend (this one is {jax.default_backend()})")
        engine = build_engine(config)
        engine.runner.set_prompt_logprob_buckets(fine=False)
        runner, vocab, sig = engine.runner, engine.vocab_size, bundle.engine_signature(engine)
    else:
        runner, vocab = compile_only_runner(config, target)
        gpu = GPU_TARGETS[target]
        sig = bundle.signature(runner, vocab, gpu.device_kind, "gpu", gpu.compute_capability)
    variants = engine_variants(runner, vocab)
    log.info("compiling %d programs for %s into %s", len(variants), target, out_dir)
    options = None if target == "cpu" else DEVICELESS_OPTIONS
    with jax.default_device(runner.compile_for or jax.devices()[0]):  # Pallas' Triton lowering looks for a GPU there
        return bundle.write(
            out_dir, variants, sig, target=target, workers=workers, progress=progress, compiler_options=options
        )
