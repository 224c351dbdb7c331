"""MXFP4: the gpt-oss checkpoint layout (`*_blocks` + `*_scales`) de-quantized by `netra_jax.loader.mxfp4` against
hand-encoded blocks and transformers' own de-quantization (tests/fixtures/mxfp4, made by the script there), the
expert tensors back in the bf16 checkpoint's layout, and GGUF's MXFP4 blocks agreeing with it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from support.checkpoints import DATA
from support.gguf_blocks import write_gguf

from netra_jax.loader import CheckpointError
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.loader.mxfp4 import dequantize_gpt_oss_experts, dequantize_mxfp4

RNG = np.random.default_rng(2)
REFERENCE = DATA / "mxfp4" / "reference.npz"
# OCP MX spec, FP4 E2M1: code bits s e e m; codes 0..7 are these magnitudes, 8..15 their negatives
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def draw(groups_shape: tuple[int, ...]):
    """Random codes [*groups_shape, 32] and E8M0 exponents [*groups_shape] (the extremes 0 and 1 included)."""
    codes = RNG.integers(0, 16, (*groups_shape, 32))
    exps = RNG.integers(100, 150, groups_shape)
    exps.reshape(-1)[:2] = [0, 1]  # 2**-127 and 2**-126: subnormal float32 results
    return codes, exps


def value_of(codes: np.ndarray, exps: np.ndarray) -> np.ndarray:  # what the codes encode, in float64
    return E2M1[codes] * 2.0 ** (exps[..., None].astype(np.float64) - 127)


def hf_pack(codes: np.ndarray) -> np.ndarray:  # [..., 32] -> [..., 16]: value 2k low nibble of byte k, 2k + 1 high
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_dequantize_mxfp4_hand_encoded():
    blocks = np.array([[0x72, 0xF9] + [0] * 14], np.uint8)  # one group: 1.0, 6.0, -0.5, -6.0, 0, ...
    got = dequantize_mxfp4(blocks, np.array([128], np.uint8))  # scale 2**1
    assert got.dtype == np.float32 and got.shape == (32,)
    assert got[:5].tolist() == [2.0, 12.0, -1.0, -12.0, 0.0] and not got[4:].any()
    codes, exps = draw((2, 3, 4))
    got = dequantize_mxfp4(hf_pack(codes), exps.astype(np.uint8))
    assert got.shape == (2, 3, 4 * 32) and got.dtype == np.float32
    np.testing.assert_array_equal(got, value_of(codes, exps).reshape(2, 3, 128).astype(np.float32))


def test_dequantize_mxfp4_refuses_bad_input():
    blocks, scales = np.zeros((3, 2, 16), np.uint8), np.zeros((3, 2), np.uint8)
    with pytest.raises(CheckpointError, match=r"blocks \(3, 2, 16\) and scales \(3, 3\) do not match"):
        dequantize_mxfp4(blocks, np.zeros((3, 3), np.uint8))
    with pytest.raises(CheckpointError, match="must be uint8"):
        dequantize_mxfp4(blocks.astype(np.int32), scales)
    with pytest.raises(CheckpointError, match=r"\[experts, rows, groups, 16\]"):
        dequantize_gpt_oss_experts(blocks, scales)


def test_matches_transformers_convert_moe_packed_tensors():
    ref = np.load(REFERENCE)
    blocks, scales, expected = ref["blocks"], ref["scales"], ref["expected"]  # expected: [E, G * 32, rows]
    got = dequantize_gpt_oss_experts(blocks, scales)
    assert got.shape == expected.shape == (3, 64, 5)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit, subnormals too
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), expected.swapaxes(1, 2))


def quantize_openai(w: np.ndarray):
    """A bf16-layout expert tensor [E, in, out] -> (blocks [E, out, in / 32, 16], scales [E, out, in / 32]) in the
    gpt-oss checkpoints' layout: each output row's inputs in groups of 32, each group with a power-of-two scale (here
    2**(floor(log2 max |w|) - 2), never below E8M0's 2**-127, which represents these tensors' values exactly)."""
    experts, n_in, n_out = w.shape
    groups = w.swapaxes(1, 2).reshape(experts, n_out, n_in // 32, 32)  # [E, out, in / 32, 32]
    amax = np.abs(groups).max(axis=-1)
    exps = np.floor(np.log2(np.where(amax > 0, amax, 1.0))).astype(np.int64) - 2 + 127
    exps = np.maximum(exps, 0)
    scaled = groups / 2.0 ** (exps[..., None] - 127)
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1)  # exact: the tensor is made of representable values
    assert np.array_equal(E2M1[codes], scaled)
    return hf_pack(codes), exps.astype(np.uint8)


@pytest.mark.parametrize("shape", [(2, 64, 2 * 32), (2, 32, 64)], ids=["gate_up_proj", "down_proj"])
def test_gpt_oss_experts_come_back_in_the_bf16_layout(shape):
    experts, n_in, n_out = shape
    codes, exps = draw((experts, n_out, n_in // 32))
    w = value_of(codes, exps).reshape(experts, n_out, n_in).swapaxes(1, 2)  # [E, in, out], the bf16 layout
    blocks, scales = quantize_openai(w)
    assert blocks.shape == (experts, n_out, n_in // 32, 16) and scales.shape == (experts, n_out, n_in // 32)
    got = dequantize_gpt_oss_experts(blocks, scales)
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, w.astype(np.float32))


def test_gguf_mxfp4_blocks_agree_with_dequantize_mxfp4(tmp_path):
    rows, groups = 3, 4
    codes, exps = draw((rows, groups))
    # GGUF's block_mxfp4 (ggml-common.h): the E8M0 byte, then byte j = value j | value j + 16 << 4
    gguf_blocks = np.concatenate([exps[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1).astype(
        np.uint8
    )  # [rows, groups, 17]
    path = write_gguf(tmp_path / "mxfp4.gguf", "llama", {}, {"w": (gguf_blocks.reshape(rows, -1), Q.MXFP4)})
    from_gguf = GGUFFile(path).tensor("w")  # [rows, groups * 32]
    ours = dequantize_mxfp4(hf_pack(codes), exps.astype(np.uint8)).reshape(rows, -1)
    expected = value_of(codes, exps).reshape(rows, -1).astype(np.float32)
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(from_gguf, expected)
