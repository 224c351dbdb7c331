"""Deliberately broken kernel configurations the compile check must fail, each for the reason it is broken: a Triton
block far over the A100's shared memory (the compiler refuses it) and the Mosaic kernel at head_dim 256 with its
probabilities staged through shared memory (it compiles, but spills registers). `gpu_compile --self-test` compiles
them and passes only when every one fails the check as expected."""

from __future__ import annotations

from benchmarks.gpu_check import configs
from netra_jax.ops.paged_attention_mosaic import MosaicConfig
from netra_jax.ops.paged_attention_triton import KernelConfig


def broken_cases() -> list[tuple[str, configs.KernelCase, str]]:
    """(target, case, a phrase the check's verdict must contain)."""
    gemma = configs.shape("gemma3-4b-local")
    decode, prefill = configs.step(configs.DECODE_FULL), configs.step(configs.PREFILL_FULL)
    oversized = KernelConfig(block_m=256, tile=256, num_splits=1, num_warps=4, num_stages=3)
    smem_p = MosaicConfig(tile=64, num_stages=2, num_splits=1, block_rows=8, p_in_registers=False)
    return [
        ("a100", configs.KernelCase("triton", gemma, "bfloat16", 16, prefill, oversized), "does not compile"),
        ("h200", configs.KernelCase("mosaic", gemma, "bfloat16", 16, decode, smem_p), "register spills"),
    ]
