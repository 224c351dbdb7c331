"""GGUF IQ types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS): blocks encoded here from
ggml-common.h's block layouts and ggml-quants.c's dequantize_row_iq*, with grid entries copied from ggml-common.h's
tables (not gguf-py's), de-quantized through a GGUF file."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from support.gguf_blocks import _nibbles, check_through_gguf, f16_bytes, f32, u8

RNG = np.random.default_rng(1)

# A few entries of ggml-common.h's grids (index -> uint64 / uint32, read as little-endian bytes), high indices
# included so the index bits kept outside the low byte are exercised.
IQ2XXS_GRID = {0: 0x0808080808080808, 37: 0x0808190819080808, 128: 0x082B2B0808082B08, 255: 0x2B2B2B1908081908}
IQ2XS_GRID = {1: 0x080808080808082B, 100: 0x0808192B08081908, 300: 0x1908190808191908, 511: 0x2B2B2B2B2B2B2B2B}
IQ2S_GRID = {5: 0x0808080808190819, 300: 0x08191908192B1908, 700: 0x1919082B2B080808, 1023: 0x2B2B2B2B2B2B2B2B}
IQ3XXS_GRID = {0: 0x04040404, 77: 0x0C140C14, 160: 0x1C1C0C0C, 255: 0x3E341C04}
IQ3S_GRID = {7: 0x01010305, 200: 0x0501010F, 300: 0x07030503, 511: 0x0F0F0101}
IQ1S_GRID = {3: 0xFFFFFFFFFFFF01FF, 500: 0xFF01FF0101FF01FF, 1300: 0x000100FF010100FF, 2047: 0x0101010101010101}
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
IQ1S_DELTA = 0.125


def grid_draw(grid: dict[int, int], shape: tuple[int, ...], width: int, signed: bool = False):
    """Random entries of `grid`: indices [*shape] and their bytes [*shape, width] (int8 when `signed`)."""
    keys = np.array(list(grid))
    table = np.array([[(v >> (8 * j)) & 0xFF for j in range(width)] for v in grid.values()])  # [K, width]
    if signed:
        table = np.where(table > 127, table - 256, table)
    pick = RNG.integers(0, len(keys), shape)
    return keys[pick], table[pick]


def signs(byte: np.ndarray) -> np.ndarray:  # [...] sign bytes -> [..., 8]: -1 where bit j is set
    return np.where((byte[..., None] >> np.arange(8)) & 1, -1.0, 1.0)


def ksigns(s7: np.ndarray) -> np.ndarray:  # ggml's ksigns_iq2xs: 7 sign bits + an 8th making the parity even
    return s7 | ((np.bitwise_count(s7.astype(np.uint8)) & 1) << 7)


def le_bytes(x: np.ndarray, dtype: str) -> np.ndarray:  # [nb, k] ints -> [nb, k * itemsize] little-endian bytes
    return x.astype(dtype).view(np.uint8).reshape(x.shape[0], -1)


def shifted(fields: np.ndarray, step: int) -> np.ndarray:  # [..., n] fields -> [...]: field l at bit step * l
    return (fields << (step * np.arange(fields.shape[-1]))).sum(axis=-1)


def enc_iq2_xxs(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 8))
    idx, grid = grid_draw(IQ2XXS_GRID, (nb, 8, 4), 8)  # [nb, 32-group, 8-group]
    s7 = RNG.integers(0, 128, (nb, 8, 4))
    aux = np.stack([shifted(idx, 8), shifted(s7, 7) | (sc << 28)], axis=-1)  # two uint32 per 32 values
    blocks = np.concatenate([f16_bytes(d), le_bytes(aux.reshape(nb, 16), "<u4")], axis=1)  # 66 bytes
    db = f32(d) * (0.5 + sc) * 0.25  # [nb, 8]
    return blocks, db[:, :, None, None] * grid * signs(ksigns(s7))


def enc_iq2_xs(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 8, 2))
    idx, grid = grid_draw(IQ2XS_GRID, (nb, 8, 4), 8)
    s7 = RNG.integers(0, 128, (nb, 8, 4))
    qs = le_bytes((idx | (s7 << 9)).reshape(nb, 32), "<u2")  # 9-bit index | 7 sign bits
    blocks = np.concatenate([f16_bytes(d), qs, u8(shifted(sc, 4))], axis=1)  # 74 bytes: d, qs[32], scales[8]
    db = (f32(d)[:, :, None] * (0.5 + sc) * 0.25)[:, :, [0, 0, 1, 1]]  # [nb, 8, 4]: groups 0-1 low, 2-3 high
    return blocks, db[..., None] * grid * signs(ksigns(s7))


def enc_iq2_s(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 8, 2))
    idx, grid = grid_draw(IQ2S_GRID, (nb, 8, 4), 8)
    sign_bytes = RNG.integers(0, 256, (nb, 8, 4))
    blocks = np.concatenate(  # 82 bytes: d, qs[32] low index bytes, signs[32], qh[8] (2 bits each), scales[8]
        [
            f16_bytes(d),
            u8(idx.reshape(nb, 32) & 255),
            u8(sign_bytes.reshape(nb, 32)),
            u8(shifted(idx >> 8, 2)),
            u8(shifted(sc, 4)),
        ],
        axis=1,
    )
    db = (f32(d)[:, :, None] * (0.5 + sc) * 0.25)[:, :, [0, 0, 1, 1]]
    return blocks, db[..., None] * grid * signs(sign_bytes)


def enc_iq3_xxs(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 8))
    idx, grid = grid_draw(IQ3XXS_GRID, (nb, 8, 8), 4)  # two 4-value entries per 8 values
    s7 = RNG.integers(0, 128, (nb, 8, 4))
    blocks = np.concatenate(  # 98 bytes: d, qs[64] indices, 8 x uint32 (4 x 7 sign bits | scale << 28)
        [f16_bytes(d), u8(idx.reshape(nb, 64)), le_bytes(shifted(s7, 7) | (sc << 28), "<u4")], axis=1
    )
    db = f32(d) * (0.5 + sc) * 0.5
    return blocks, db[:, :, None, None] * grid.reshape(nb, 8, 4, 8) * signs(ksigns(s7))


def enc_iq3_s(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 8))
    idx, grid = grid_draw(IQ3S_GRID, (nb, 8, 8), 4)
    sign_bytes = RNG.integers(0, 256, (nb, 8, 4))
    blocks = np.concatenate(  # 110 bytes: d, qs[64] low index bytes, qh[8] (bit 8 of each), signs[32], scales[4]
        [
            f16_bytes(d),
            u8(idx.reshape(nb, 64) & 255),
            u8(shifted(idx >> 8, 1)),
            u8(sign_bytes.reshape(nb, 32)),
            u8(sc[:, 0::2] | (sc[:, 1::2] << 4)),
        ],
        axis=1,
    )
    db = f32(d) * (1 + 2 * sc)
    return blocks, db[:, :, None, None] * grid.reshape(nb, 8, 4, 8) * signs(sign_bytes)


def enc_iq1_s(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 8, (nb, 8))
    idx, grid = grid_draw(IQ1S_GRID, (nb, 8, 4), 8, signed=True)
    neg = RNG.integers(0, 2, (nb, 8))
    qh = shifted(idx >> 8, 3) | (sc << 12) | (neg << 15)  # 3 index bits per 8 values, 3-bit scale, delta sign
    blocks = np.concatenate([f16_bytes(d), u8(idx.reshape(nb, 32) & 255), le_bytes(qh, "<u2")], axis=1)  # 50
    dl, delta = f32(d) * (2 * sc + 1), np.where(neg, -IQ1S_DELTA, IQ1S_DELTA)
    return blocks, dl[:, :, None, None] * (grid + delta[:, :, None, None])


def enc_iq1_m(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 8, (nb, 8, 2))
    idx, grid = grid_draw(IQ1S_GRID, (nb, 8, 4), 8, signed=True)
    neg = RNG.integers(0, 2, (nb, 8, 4))
    nibble = ((idx >> 8) | (neg << 3)).reshape(nb, 16, 2)  # per 8 values: 3 index bits | delta sign
    d_bits = d.view(np.uint16).astype(np.int64)[:, None] >> (4 * np.arange(4)) & 15  # [nb, 4] nibbles of d
    scales = shifted(sc.reshape(nb, 4, 4), 3) | (d_bits << 12)  # uint16 k: 3-bit scales of 2k, 2k + 1 | d nibble
    blocks = np.concatenate(  # 56 bytes: qs[32], qh[16], scales[8]
        [u8(idx.reshape(nb, 32) & 255), u8(shifted(nibble, 4)), le_bytes(scales, "<u2")], axis=1
    )
    dl = (f32(d)[:, :, None] * (2 * sc + 1))[:, :, [0, 0, 1, 1]]  # [nb, 8, 4]
    delta = np.where(neg, -IQ1S_DELTA, IQ1S_DELTA)
    return blocks, dl[..., None] * (grid + delta[..., None])


def enc_iq4_nl(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.01, 0.01, nb).astype(np.float16), RNG.integers(0, 16, (nb, 32))
    return np.concatenate([f16_bytes(d), _nibbles(q)], axis=1), f32(d) * KVALUES_IQ4NL[q]  # 18 bytes


def enc_iq4_xs(rows: int, cols: int):
    nb = rows * cols // 256
    d, ls = RNG.uniform(-0.01, 0.01, nb).astype(np.float16), RNG.integers(0, 64, (nb, 8))
    q = RNG.integers(0, 16, (nb, 8, 32))
    blocks = np.concatenate(  # 136 bytes: d, scales_h (2 high bits of each 6-bit scale), scales_l[4], qs[128]
        [
            f16_bytes(d),
            le_bytes(shifted(ls >> 4, 2)[:, None], "<u2"),
            u8((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)),
            _nibbles(q.reshape(nb * 8, 32)).reshape(nb, 128),
        ],
        axis=1,
    )
    return blocks, (f32(d) * (ls - 32))[:, :, None] * KVALUES_IQ4NL[q]


IQ_ENCODERS = {
    Q.IQ2_XXS: enc_iq2_xxs,
    Q.IQ2_XS: enc_iq2_xs,
    Q.IQ2_S: enc_iq2_s,
    Q.IQ3_XXS: enc_iq3_xxs,
    Q.IQ3_S: enc_iq3_s,
    Q.IQ1_S: enc_iq1_s,
    Q.IQ1_M: enc_iq1_m,
    Q.IQ4_NL: enc_iq4_nl,
    Q.IQ4_XS: enc_iq4_xs,
}


def test_dequantize_each_iq_type_through_a_gguf_file(tmp_path):
    check_through_gguf(tmp_path / "iq.gguf", IQ_ENCODERS)
