"""Section `quant`: the Llama-3-8B-shaped model of section `model` with its weights quantized at load
(`LLM(quantization=...)`: "int4", llama.cpp's Q4_0 values, W4A16; "fp8", e4m3 with per-channel scales), through
`LLM.generate` on the GPU matmul backend (`netra_jax.quant.gpu`, what "auto" picks on CUDA): int4 as PackedIntWeight
on the Pallas W4A16 kernel, fp8 as W8A8 on XLA's fp8 dot on Hopper (the W8A16 reference elsewhere). Measures batch-1
decode tok/s with its memory-bandwidth use against the quantized weights' bytes (MBU), and output throughput of 100
sequences generated together. The dry run interprets the same kernel ("gpu_interpret") on the CPU.

Each method builds its own engine after the previous one is freed, sized as the serve section's (and from its
bundle when the run carries one); the warm-up is capped as in `model`."""

from __future__ import annotations

import functools
import gc
import time

import jax

from benchmarks.gpu_check import engine_settings
from benchmarks.gpu_check.bundles import carried
from benchmarks.gpu_check.common import Section, sig
from benchmarks.gpu_check.model import batch1, throughput, warm_up
from benchmarks.gpu_check.model_dir import ensure_model_dir, model_config

METHODS = ("int4", "fp8")
MATMUL_BACKEND = {False: "auto", True: "gpu_interpret"}  # the device's GPU kernels; the dry run interprets them
BATCH = {False: 100, True: 4}  # the throughput point: 100 sequences on the device, 4 in the dry run


def weight_bytes_held(params) -> int:
    """Bytes of the parameters as held (quantized data and scales, a buffer shared by two leaves once)."""
    return sum({id(a): a.nbytes for a in jax.tree.leaves(params)}.values())


def run(sec: Section) -> None:
    from netra_jax import LLM

    path = ensure_model_dir(sec.work, sec.dry)
    cfg = model_config(sec.dry)
    batch = BATCH[sec.dry]
    backend = {"matmul_backend": MATMUL_BACKEND[sec.dry]}
    sec.set("engine", backend | {"methods": METHODS, "throughput_batch": batch})
    for i, method in enumerate(METHODS):
        share = sec.left() / (len(METHODS) - i)  # this method's part of what is left
        if share < (5 if sec.dry else 40):
            sec.skip("methods", {"method": method}, f"time budget ({sec.left():.0f}s left)")
            continue
        size = engine_settings.sizing(path, sec.target(), sec.dry, method)
        compiled = carried(sec.target(), method)  # the fp8 bundle, when the run carries one
        kwargs = engine_settings.llm_kwargs(size, str(compiled) if compiled else None) | backend
        t = time.perf_counter()
        llm = LLM(str(path), **kwargs, quantization=method)
        build = time.perf_counter() - t
        runner = llm.engine.runner
        held = weight_bytes_held(runner.params)
        layout = type(runner.params["layers"][0]["wq"]).__name__  # PackedIntWeight for the W4A16 kernel
        cap = 3.0 if sec.dry else max(5.0, 0.4 * share)
        sz = sec.sizes  # the steps of the two measurements first
        first = [1, sz.prompt_len, batch, min(batch * sz.prompt_len, kwargs["max_num_batched_tokens"])]
        warm = warm_up(llm.engine, first, cap)
        ready = {"method": method, "matmul_backend": runner.matmul_backend, "weights": layout}
        sec.add("ready", ready | {"build_s": sig(build), "weights_gb": sig(held / 1e9), "warmup": warm})
        sec.attempt("batch1", {"method": method}, functools.partial(batch1, sec, llm, cfg, held), 2 if sec.dry else 15)
        sec.attempt(
            "throughput", {"method": method}, functools.partial(throughput, sec, llm, cfg, batch), 2 if sec.dry else 15
        )
        del llm
        gc.collect()
