"""Section `quant`: the Llama-3-8B-shaped model of section `model` with its weights quantized at load
(`LLM(quantization=...)`: "int4", llama.cpp's Q4_0 blocks, W4A16; "fp8", e4m3 with per-channel scales, W8A16),
through `LLM.generate`: batch-1 decode tok/s with its memory-bandwidth use against the quantized weights' bytes
(MBU), and output throughput of 100 sequences generated together.

No Pallas W4A16 / W8A16 kernel exists yet: on the GPU both run the jnp reference (`models.quant.matmul`: the blocks
or the fp8 weights de-quantized in XLA, then its dot), so these figures are the baseline such kernels are measured
against. Each method builds its own engine after the previous one is freed; the warm-up is capped as in `model`."""

from __future__ import annotations

import functools
import gc
import time

import jax

from gpu_check import engine_settings
from gpu_check.common import Section, sig
from gpu_check.model import batch1, throughput, warm_up
from gpu_check.model_dir import ensure_model_dir, model_config

METHODS = ("int4", "fp8")
BATCH = {False: 100, True: 4}  # the throughput point: 100 sequences on the device, 4 in the dry run


def weight_bytes_held(params) -> int:
    """Bytes of the parameters as held (quantized data and scales, a buffer shared by two leaves once)."""
    return sum({id(a): a.nbytes for a in jax.tree.leaves(params)}.values())


def run(sec: Section) -> None:
    from netra_jax import LLM

    path = ensure_model_dir(sec.work, sec.dry)
    cfg = model_config(sec.dry)
    kwargs = engine_settings.llm_kwargs(sec.dry)
    batch = BATCH[sec.dry]
    sec.set("engine", kwargs | {"methods": METHODS, "throughput_batch": batch})
    for i, method in enumerate(METHODS):
        share = sec.left() / (len(METHODS) - i)  # this method's part of what is left
        if share < (5 if sec.dry else 40):
            sec.skip("methods", {"method": method}, f"time budget ({sec.left():.0f}s left)")
            continue
        t = time.perf_counter()
        llm = LLM(str(path), **kwargs, quantization=method)
        build = time.perf_counter() - t
        held = weight_bytes_held(llm.engine.runner.params)
        cap = 3.0 if sec.dry else max(5.0, 0.4 * share)
        sz = sec.sizes  # the steps of the two measurements first
        first = [1, sz.prompt_len, batch, min(batch * sz.prompt_len, kwargs["max_num_batched_tokens"])]
        warm = warm_up(llm.engine, first, cap)
        sec.add("ready", {"method": method, "build_s": sig(build), "weights_gb": sig(held / 1e9), "warmup": warm})
        sec.attempt("batch1", {"method": method}, functools.partial(batch1, sec, llm, cfg, held), 2 if sec.dry else 15)
        sec.attempt(
            "throughput", {"method": method}, functools.partial(throughput, sec, llm, cfg, batch), 2 if sec.dry else 15
        )
        del llm
        gc.collect()
