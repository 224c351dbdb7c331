"""GGML blocks encoded from ggml's definitions (each encoder returns the block bytes and the values they hold), GGUF
files written with gguf-py's writer, and the float64 values of activations as the GGML CPU kernel rounds them to
int8: shared by the GGUF, loader and CPU-kernel tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from netra_jax.loader.gguf_loader import GGUFFile

RNG = np.random.default_rng(0)


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    """meta: key -> python value (int: uint32, float: float32, str, bool, list) or (value, GGUFValueType[, subtype]).
    tensors: name -> float32/float16 array, or (uint8 bytes [rows, row bytes], GGML type)."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        if isinstance(v, tuple):
            w.add_key_value(k, *v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------- block encoders written from ggml-common.h's layouts
# Each encoder draws random codes, packs them as ggml-common.h's block_* struct and ggml-quants.c's dequantize_row_*
# read them, and returns (blocks [n_blocks, block bytes], the values those codes stand for by definition).
def f16_bytes(x: np.ndarray) -> np.ndarray:  # [n] float -> [n, 2] uint8
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def u8(x: np.ndarray) -> np.ndarray:  # packed codes (< 256) -> bytes
    assert x.min() >= 0 and x.max() < 256
    return x.astype(np.uint8)


def f32(x: np.ndarray) -> np.ndarray:  # float16 block scales [n] -> float32 [n, 1], as ggml widens them
    return x.astype(np.float32)[:, None]


def _nibbles(q: np.ndarray) -> np.ndarray:  # [nb, 32] in 0..15 -> [nb, 16]: element j low nibble, j + 16 high
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _bit4_mask(q: np.ndarray) -> np.ndarray:  # [nb, 32] 5-bit codes -> qh[4]: bit i of the LE uint32 = bit 4 of i
    qh = ((q >> 4) << np.arange(32)).sum(axis=1).astype("<u4")
    return qh.reshape(-1, 1).view(np.uint8)


def _crumbs(q: np.ndarray) -> np.ndarray:  # [nb, 256] 2-bit -> [nb, 64]: value 128h + 32j + l in byte 32h + l, bits 2j
    return (q.reshape(-1, 2, 4, 32) << (2 * np.arange(4))[:, None]).sum(axis=2).reshape(-1, 64)


def _k_nibbles(q: np.ndarray) -> np.ndarray:  # [nb, 256] 4-bit -> [nb, 128]: value 64p + l low, 64p + 32 + l high
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:  # 6-bit [nb, 8] x2 -> [nb, 12], get_scale_min_k4
    scales = np.zeros((sc.shape[0], 12), np.int64)  # j < 4 direct (+2 high bits of j + 4), j >= 4 nibbles
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return u8(scales)


def enc_q8_0(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(-128, 128, (nb, 32)).astype(np.int8)
    blocks = np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)  # 34 bytes: d, qs[32]
    return blocks, f32(d) * q


def enc_q4_0(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 32))
    return np.concatenate([f16_bytes(d), _nibbles(q)], axis=1), f32(d) * (q - 8)


def enc_q4_1(rows: int, cols: int):
    nb = rows * cols // 32
    d, m = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.uniform(-1, 1, nb).astype(np.float16)
    q = RNG.integers(0, 16, (nb, 32))
    blocks = np.concatenate([f16_bytes(d), f16_bytes(m), _nibbles(q)], axis=1)  # 20 bytes: d, m, qs[16]
    return blocks, f32(d) * q + f32(m)


def enc_q5_0(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 32, (nb, 32))
    blocks = np.concatenate([f16_bytes(d), _bit4_mask(q), _nibbles(q & 15)], axis=1)  # 22 bytes: d, qh[4], qs[16]
    return blocks, f32(d) * (q - 16)


def enc_q5_1(rows: int, cols: int):
    nb = rows * cols // 32
    d, m = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.uniform(-1, 1, nb).astype(np.float16)
    q = RNG.integers(0, 32, (nb, 32))
    blocks = np.concatenate([f16_bytes(d), f16_bytes(m), _bit4_mask(q), _nibbles(q & 15)], axis=1)  # 24 bytes
    return blocks, f32(d) * q + f32(m)


def enc_q2_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, dmin = RNG.uniform(0, 0.01, nb).astype(np.float16), RNG.uniform(0, 0.01, nb).astype(np.float16)
    sc, mn, q = RNG.integers(0, 16, (nb, 16)), RNG.integers(0, 16, (nb, 16)), RNG.integers(0, 4, (nb, 256))
    blocks = np.concatenate(  # 84 bytes: scales[16] (scale | min << 4), qs[64], d, dmin
        [u8(sc | (mn << 4)), u8(_crumbs(q)), f16_bytes(d), f16_bytes(dmin)], axis=1
    )
    sub = np.arange(256) // 16
    return blocks, f32(d) * sc[:, sub] * q - f32(dmin) * mn[:, sub]


def enc_q3_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc, q = (
        RNG.uniform(-0.01, 0.01, nb).astype(np.float16),
        RNG.integers(0, 64, (nb, 16)),
        RNG.integers(0, 8, (nb, 256)),
    )
    high_bit = (q >> 2).reshape(nb, 2, 4, 32)  # value 128h + 32j + l: bit 4h + j of hmask[l]
    hmask = (high_bit << (4 * np.arange(2)[:, None] + np.arange(4))[:, :, None]).sum(axis=(1, 2))
    scales = np.zeros((nb, 12), np.int64)  # 6-bit scales: low nibbles of 0..7 | 8..15 << 4, then the 2 high bits
    scales[:, 0:8] = (sc[:, 0:8] & 15) | ((sc[:, 8:16] & 15) << 4)
    scales[:, 8:12] = sum((sc[:, 4 * k : 4 * k + 4] >> 4) << (2 * k) for k in range(4))
    blocks = np.concatenate([u8(hmask), u8(_crumbs(q & 3)), u8(scales), f16_bytes(d)], axis=1)  # 110 bytes
    return blocks, f32(d) * (sc[:, np.arange(256) // 16] - 32) * (q - 4)


def enc_q4_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, dmin = RNG.uniform(0, 0.01, nb).astype(np.float16), RNG.uniform(0, 0.01, nb).astype(np.float16)
    sc, mn, q = RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 16, (nb, 256))
    blocks = np.concatenate([f16_bytes(d), f16_bytes(dmin), _k4_scales(sc, mn), u8(_k_nibbles(q))], axis=1)
    sub = np.arange(256) // 32
    return blocks, f32(d) * sc[:, sub] * q - f32(dmin) * mn[:, sub]


def enc_q5_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, dmin = RNG.uniform(0, 0.01, nb).astype(np.float16), RNG.uniform(0, 0.01, nb).astype(np.float16)
    sc, mn, q = RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 32, (nb, 256))
    qh = ((q >> 4).reshape(nb, 8, 32) << np.arange(8)[:, None]).sum(axis=1)  # value 32s + l: bit s of qh[l]
    blocks = np.concatenate(  # 176 bytes: d, dmin, scales[12], qh[32], qs[128]
        [f16_bytes(d), f16_bytes(dmin), _k4_scales(sc, mn), u8(qh), u8(_k_nibbles(q & 15))], axis=1
    )
    sub = np.arange(256) // 32
    return blocks, f32(d) * sc[:, sub] * q - f32(dmin) * mn[:, sub]


def enc_q6_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, sc = RNG.uniform(0, 0.01, nb).astype(np.float16), RNG.integers(-128, 128, (nb, 16)).astype(np.int8)
    q = RNG.integers(0, 64, (nb, 256))
    ql, qh = np.zeros((nb, 128), np.int64), np.zeros((nb, 64), np.int64)
    for h in range(2):
        for lane in range(32):
            q1, q2, q3, q4 = (q[:, 128 * h + 32 * k + lane] for k in range(4))
            ql[:, 64 * h + lane] = (q1 & 15) | ((q3 & 15) << 4)
            ql[:, 64 * h + 32 + lane] = (q2 & 15) | ((q4 & 15) << 4)
            qh[:, 32 * h + lane] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    blocks = np.concatenate([u8(ql), u8(qh), sc.view(np.uint8), f16_bytes(d)], axis=1)
    return blocks, f32(d) * sc[:, np.arange(256) // 16].astype(np.float32) * (q - 32)


def enc_q8_k(rows: int, cols: int):  # de-quantized by the loader itself (gguf-py has no Q8_K)
    nb = rows * cols // 256
    d, q = RNG.uniform(-0.01, 0.01, (nb, 1)).astype("<f4"), RNG.integers(-128, 128, (nb, 256)).astype(np.int8)
    bsums = q.reshape(nb, 16, 16).sum(axis=2, dtype=np.int64).astype("<i2")
    blocks = np.concatenate([d.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], axis=1)  # 292 bytes
    return blocks, d * q


def _trit_bytes(t: np.ndarray) -> np.ndarray:  # [..., 5] base-3 digits, first most significant -> ggml's byte
    v = (t * 3 ** np.arange(4, -1, -1)).sum(axis=-1)
    return (v * 256 + 242) // 243  # ceil(v * 256 / 243): digit n is ((byte * 3**n) % 256 * 3) >> 8


def enc_tq1_0(rows: int, cols: int):
    nb = rows * cols // 256
    d, t = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 3, (nb, 256))
    qs32 = _trit_bytes(t[:, :160].reshape(nb, 5, 32).transpose(0, 2, 1))  # byte m: values 32n + m
    qs16 = _trit_bytes(t[:, 160:240].reshape(nb, 5, 16).transpose(0, 2, 1))  # byte 32 + m: values 160 + 16n + m
    last = t[:, 240:].reshape(nb, 4, 4).transpose(0, 2, 1)  # qh byte j: values 240 + 4n + j, a fifth digit of 0
    qh = _trit_bytes(np.concatenate([last, np.zeros((nb, 4, 1), np.int64)], axis=2))
    blocks = np.concatenate([u8(qs32), u8(qs16), u8(qh), f16_bytes(d)], axis=1)  # 54 bytes: qs[48], qh[4], d
    return blocks, f32(d) * (t - 1)


def enc_tq2_0(rows: int, cols: int):
    nb = rows * cols // 256
    d, t = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 3, (nb, 256))
    return np.concatenate([u8(_crumbs(t)), f16_bytes(d)], axis=1), f32(d) * (t - 1)  # 66 bytes: qs[64], d


ENCODERS = {
    Q.Q8_0: enc_q8_0,
    Q.Q4_0: enc_q4_0,
    Q.Q4_1: enc_q4_1,
    Q.Q5_0: enc_q5_0,
    Q.Q5_1: enc_q5_1,
    Q.Q2_K: enc_q2_k,
    Q.Q3_K: enc_q3_k,
    Q.Q4_K: enc_q4_k,
    Q.Q5_K: enc_q5_k,
    Q.Q6_K: enc_q6_k,
    Q.Q8_K: enc_q8_k,
    Q.TQ1_0: enc_tq1_0,
    Q.TQ2_0: enc_tq2_0,
}


def check_through_gguf(path: Path, encoders: dict, rows: int = 3, cols: int = 512, extra: dict | None = None):
    """Write one tensor per encoder (plus `extra`: name -> (tensor, expected)) into a GGUF file and compare what the
    loader de-quantizes with the values the blocks encode."""
    tensors, expect = {}, {}
    for qt, enc in encoders.items():
        blocks, ref = enc(rows, cols)
        tensors[f"w_{qt.name}"] = (blocks.reshape(rows, -1), qt)
        expect[f"w_{qt.name}"] = np.asarray(ref).reshape(rows, cols)
    for name, (tensor, ref) in (extra or {}).items():
        tensors[name], expect[name] = tensor, ref
    gf = GGUFFile(write_gguf(path, "llama", {}, tensors))
    for name, ref in expect.items():
        assert gf.tensors[name].shape == (rows, cols)
        got = gf.tensor(name)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=name)
        assert np.ptp(ref) > 0, name  # the blocks encode varied values


def int8_rounded(x, qtype):
    """float64 of float32 x [M, K] as the GGML kernel's int8 activations for `qtype` blocks read it
    (netra_jax.ops.cpu_ggml_matmul): per block of 32 values (256 against the K-quants, llama.cpp's Q8_K),
    d = max|x| / 127 and q = x * (127 / max|x|) rounded to nearest even, in float32 as the kernel computes them, then
    d * q."""
    import numpy as np

    size = 256 if qtype.endswith("_K") else 32
    m, k = x.shape
    xb = x.reshape(m, k // size, size)
    amax = np.abs(xb).max(-1, keepdims=True)  # float32
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inverse)
    return (d.astype(np.float64) * q).reshape(m, k)
