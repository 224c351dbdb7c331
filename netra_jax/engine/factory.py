"""The engine's factory: from a checked EngineConfig to a running LLMEngine. Loads the checkpoint (after what depends
on the machine and the files was checked: backend, devices, the model's and tokenizer's headers), quantizes and
lays out its weights for the matmul backend, sizes the KV cache and, unless told not to, compiles every step bucket.
Every way in (`LLM`, the command line, Ray Serve) builds its engine here."""

from __future__ import annotations

import logging
import os
import time

import jax

from netra_jax import assets, parallel
from netra_jax.config import ConfigError
from netra_jax.engine import bundle
from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.runner import claim_gpu_memory
from netra_jax.engine_config import EngineConfig
from netra_jax.loader import load_config, load_model, quantization_method
from netra_jax.models.transformer import fuse_qkv
from netra_jax.pooling import pooling_spec
from netra_jax.quant import leaf_layout, quantize_params, weight_layout
from netra_jax.tokenization.tokenizer import Tokenizer

__all__ = ["build_engine", "enable_compilation_cache", "resolve_model_path"]

log = logging.getLogger(__name__)
_CACHE_SET = False


def enable_compilation_cache(path: str | None) -> None:
    """Persistent XLA compilation cache so a restart reuses the compiled step buckets: `path`, else
    $JAX_COMPILATION_CACHE_DIR, else <cache dir>/xla ("" = off). Every compiled program is stored, however quick its
    compile or small its executable (jax's defaults skip those under 1 s)."""
    global _CACHE_SET
    if _CACHE_SET or path == "":
        return
    path = path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(assets.cache_dir() / "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _CACHE_SET = True


def resolve_model_path(model: str | os.PathLike | None) -> str:
    return str(assets.default_model_path()) if not model else str(model)


def build_engine(config: EngineConfig) -> LLMEngine:
    """Load the model and tokenizer, allocate the KV pages and (unless config.warmup is False) compile every bucket.
    The options were checked when `config` was built; what depends on the machine or the files (the attention
    backend on this platform, the devices for tensor parallelism, the model's and tokenizer's headers) is checked
    here, before any weight is read."""
    claim_gpu_memory(config.cache.gpu_memory_utilization)  # before anything starts jax's backends
    enable_compilation_cache(config.compilation_cache_dir)
    if config.compiled:  # not a bundle: an error now; the KV cache's size from it when compiled for this device
        config = bundle.sized_like(config, bundle.read_manifest(config.compiled))
    path = resolve_model_path(config.model)
    t0 = time.perf_counter()
    config.resolved_backend()  # a GPU kernel asked for off GPU fails now, not at the first step
    tp = config.tensor_parallel_size
    mesh = parallel.make_mesh(tp) if tp > 1 else None
    remote = config.trust_remote_code
    header_cfg = load_config(path, trust_remote_code=remote)  # path, format and architecture from headers alone,
    config.check_model(header_cfg)
    quantization = _quantization_at_load(config.quantization, quantization_method(path), path)
    tokenizer = _load_tokenizer(config, path, header_cfg.vocab_size)  # then the tokenizer: all before the weights
    pooling = None
    if config.task == "embed":  # and the pooling (sentence-transformers modules), before the weights too
        pooling = pooling_spec(path, header_cfg.hidden_size, config.pooler_config)
    backend = config.resolved_matmul_backend()
    cfg, params = load_model(  # a method asked for re-quantizes a GGUF file's weights from their float values
        path,
        config.dtype,
        mesh=mesh,
        load_format=config.load_format,
        task=config.task,
        trust_remote_code=remote,
        keep_quantized=not quantization,
        layout=leaf_layout(backend),  # each kept weight re-laid for the backend's kernels as it is placed
    )
    if quantization:
        params = quantize_params(params, quantization)
    params = weight_layout(params, backend)  # what online quantization made, re-laid too (the rest: unchanged)
    if mesh is None and jax.default_backend() == "cpu":  # one q/k/v matmul a layer instead of three
        params = fuse_qkv(params)
    draft = _load_draft(config, tokenizer) if config.speculative and config.task == "generate" else None
    engine = LLMEngine(config, cfg, params, tokenizer, pooling, draft)
    log.info("loaded %s in %.1fs; KV cache %d tokens", path, time.perf_counter() - t0, engine.kv_capacity_tokens)
    if config.compiled:
        report = engine.load_compiled(config.compiled)
        if report.mismatch:
            log.warning("compiled programs in %s not used, compiling instead: %s", config.compiled, report.mismatch)
        else:
            log.info("loaded %d compiled programs from %s in %.2fs", report.loaded, config.compiled, report.seconds)
    if config.warmup:
        engine.warmup()
    return engine


def _quantization_at_load(asked: str | None, stored: str | None, path: str) -> str | None:
    """The method to quantize the loaded weights by: the one asked for, or None for a checkpoint already quantized
    (read as stored). As vLLM, asking for a method other than the checkpoint's own is an error; asking for its own
    ("fp8" of an FP8 checkpoint) changes nothing."""
    if asked is None or stored is None:
        return asked
    if asked != stored:
        raise ConfigError(
            f"{path} is quantized by {stored}, which is served as stored; quantization={asked!r} differs from it "
            "(leave quantization unset)"
        )
    return None


def _load_tokenizer(config: EngineConfig, model_path: str, vocab_size: int) -> Tokenizer:
    """The model's own tokenizer, or `config.tokenizer` (a directory, tokenizer.json or .gguf) when given; a
    tokenizer with more tokens than the model's vocabulary is refused."""
    if not config.tokenizer:
        return Tokenizer.load(model_path)
    tokenizer = Tokenizer.load(config.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {config.tokenizer} has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
            f"{vocab_size}"
        )
    return tokenizer


def _load_draft(config: EngineConfig, tokenizer: Tokenizer):
    """The draft model of method "draft_model" as (ModelConfig, params), after checking its tokenizer is the
    target's; None for proposers without a model."""
    spec = config.speculative
    if spec.method != "draft_model":
        return None
    from netra_jax.engine.spec.draft import check_same_tokenizer

    path = resolve_model_path(spec.model)
    load_config(path, trust_remote_code=config.trust_remote_code)
    check_same_tokenizer(tokenizer, Tokenizer.load(path))
    return load_model(path, config.dtype, trust_remote_code=config.trust_remote_code)
