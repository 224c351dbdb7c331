"""MXFP4 de-quantization of the OpenAI / Hugging Face gpt-oss checkpoint layout (`*_blocks` + `*_scales` tensors),
and of gpt-oss's expert tensors into the layout of the bf16 checkpoint's `gate_up_proj` / `down_proj`.

Format (OCP Microscaling MXFP4, as the gpt-oss safetensors store it): `blocks` uint8 [..., G, 16] holds 32 FP4
E2M1 values per group of 32, two per byte, low nibble first (value 2k is byte k & 0xF, value 2k + 1 is byte k >> 4);
`scales` uint8 [..., G] holds each group's E8M0 exponent biased by 127, so a value is fp4 * 2**(scale - 127). E2M1
codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same with the sign bit (3) set.

What transformers does with gpt-oss (integrations/mxfp4.py: `Mxfp4Dequantize` -> `convert_moe_packed_tensors`,
used when the model loads de-quantized, e.g. on CPU): `mlp.experts.gate_up_proj_blocks` [E, 2I, hidden / 32, 16]
with `_scales` [E, 2I, hidden / 32] de-quantizes to [E, 2I, hidden], and `down_proj_blocks` [E, hidden, I / 32, 16]
to [E, hidden, I]; then `.transpose(1, 2)` gives [E, hidden, 2I] and [E, I, hidden], the bf16 checkpoint's
`gate_up_proj` and `down_proj` ([in, out] per expert; gate_up's columns interleave gate = [..., ::2] and
up = [..., 1::2]). `dequantize_gpt_oss_experts` returns exactly that.

GGUF's MXFP4 type is a different byte layout (per block of 32: the E8M0 byte, then 16 bytes where value j is the low
nibble of byte j and value j + 16 its high nibble); it goes through `gguf.quants` with the other GGML types."""

from __future__ import annotations

import numpy as np

from netra_jax.loader.errors import CheckpointError

__all__ = ["FP4_E2M1", "dequantize_mxfp4", "dequantize_gpt_oss_experts"]

FP4_E2M1 = np.array(  # code -> value; bit 3 is the sign
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_GROUPS_PER_CHUNK = 1 << 20  # bounds the temporaries to ~128 MiB on gpt-oss-120b-sized tensors


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32] (the values transformers'
    `convert_moe_packed_tensors` computes, before its transpose)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match: "
            "expected blocks [..., G, 16] and scales [..., G]"
        )
    flat_blocks = blocks.reshape(-1, 16)  # [groups, 16]
    flat_scales = scales.reshape(-1)  # [groups]
    out = np.empty((flat_blocks.shape[0], 32), np.float32)  # [groups, 32]
    for start in range(0, flat_blocks.shape[0], _GROUPS_PER_CHUNK):
        rows = slice(start, start + _GROUPS_PER_CHUNK)
        packed = flat_blocks[rows]
        out[rows, 0::2] = FP4_E2M1[packed & 0x0F]
        out[rows, 1::2] = FP4_E2M1[packed >> 4]
        with np.errstate(over="ignore", invalid="ignore"):  # past float32's range is inf, as in transformers
            scale = np.ldexp(np.float32(1.0), flat_scales[rows].astype(np.int32) - 127)  # [chunk] float32
            out[rows] *= scale[:, None]
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def dequantize_gpt_oss_experts(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss expert tensor from its MXFP4 pair, in the bf16 checkpoint's layout (a transposed view).

    `gate_up_proj_blocks` [E, 2I, hidden / 32, 16] -> `gate_up_proj` [E, hidden, 2I];
    `down_proj_blocks` [E, hidden, I / 32, 16] -> `down_proj` [E, I, hidden]."""
    blocks = np.asarray(blocks)
    if blocks.ndim != 4:
        raise CheckpointError(f"gpt-oss MXFP4 expert blocks must be [experts, rows, groups, 16], got {blocks.shape}")
    return dequantize_mxfp4(blocks, scales).swapaxes(1, 2)  # [E, rows, in] -> [E, in, rows]
