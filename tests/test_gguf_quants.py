"""GGUF block layouts: every supported quantization encoded here from ggml's spec and de-quantized through a GGUF
file, gguf-py's own quantizer round trip, and the header parser against gguf-py's reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

from netra_jax.loader import gguf_loader, read_gguf_metadata
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
def f16_bytes(x: np.ndarray) -> np.ndarray:  # [n] float -> [n, 2] uint8
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def enc_q8_0(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(-128, 128, (nb, 32)).astype(np.int8)
    blocks = np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)  # 34 bytes: d, qs[32]
    return blocks, d.astype(np.float32)[:, None] * q


def _nibbles(q: np.ndarray) -> np.ndarray:  # [nb, 32] in 0..15 -> [nb, 16]: element j low nibble, j + 16 high
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def enc_q4_0(rows: int, cols: int):
    nb = rows * cols // 32
    d, q = RNG.uniform(-0.1, 0.1, nb).astype(np.float16), RNG.integers(0, 16, (nb, 32))
    return np.concatenate([f16_bytes(d), _nibbles(q)], axis=1), d.astype(np.float32)[:, None] * (q - 8)


def enc_q4_1(rows: int, cols: int):
    nb = rows * cols // 32
    d, m = RNG.uniform(0, 0.1, nb).astype(np.float16), RNG.uniform(-1, 1, nb).astype(np.float16)
    q = RNG.integers(0, 16, (nb, 32))
    blocks = np.concatenate([f16_bytes(d), f16_bytes(m), _nibbles(q)], axis=1)  # 20 bytes: d, m, qs[16]
    return blocks, d.astype(np.float32)[:, None] * q + m.astype(np.float32)[:, None]


def enc_q4_k(rows: int, cols: int):
    nb = rows * cols // 256
    d, dmin = RNG.uniform(0, 0.01, nb).astype(np.float16), RNG.uniform(0, 0.01, nb).astype(np.float16)
    sc, mn, q = RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 64, (nb, 8)), RNG.integers(0, 16, (nb, 256))
    scales = np.zeros((nb, 12), np.int64)  # 6-bit scales/mins: j < 4 direct (+2 high bits of j + 4), j >= 4 nibbles
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qs = np.concatenate([q[:, 64 * p : 64 * p + 32] | (q[:, 64 * p + 32 : 64 * p + 64] << 4) for p in range(4)], 1)
    blocks = np.concatenate([f16_bytes(d), f16_bytes(dmin), scales.astype(np.uint8), qs.astype(np.uint8)], axis=1)
    sub = np.arange(256) // 32
    ref = d.astype(np.float32)[:, None] * sc[:, sub] * q - dmin.astype(np.float32)[:, None] * mn[:, sub]
    return blocks, ref


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
    blocks = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), sc.view(np.uint8), f16_bytes(d)], axis=1)
    ref = d.astype(np.float32)[:, None] * sc[:, np.arange(256) // 16].astype(np.float32) * (q - 32)
    return blocks, ref


ENCODERS = {Q.Q8_0: enc_q8_0, Q.Q4_0: enc_q4_0, Q.Q4_1: enc_q4_1, Q.Q4_K: enc_q4_k, Q.Q6_K: enc_q6_k}


def test_dequantize_each_type_through_a_gguf_file(tmp_path):
    rows, cols = 3, 512
    tensors, expect = {}, {}
    for qt, enc in ENCODERS.items():
        blocks, ref = enc(rows, cols)
        tensors[f"w_{qt.name}"] = (blocks.reshape(rows, -1), qt)
        expect[f"w_{qt.name}"] = ref.reshape(rows, cols)
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    tensors["w_F32"], expect["w_F32"] = x, x
    tensors["w_F16"], expect["w_F16"] = x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated bfloat16 bits
    tensors["w_BF16"] = (bf.view(np.uint8).reshape(rows, -1), Q.BF16)
    expect["w_BF16"] = (bf.astype(np.uint32) << 16).view(np.float32)
    gf = GGUFFile(write_gguf(tmp_path / "q.gguf", "llama", {}, tensors))
    for name, ref in expect.items():
        assert gf.tensors[name].shape == (rows, cols)
        got = gf.tensor(name)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16])
def test_quantize_round_trip_error_bound(qt):
    x = RNG.standard_normal((8, 256)).astype(np.float32)
    got = gguf_loader.dequantize(gguf.quants.quantize(x, qt), qt, x.shape)
    blocks, err = x.reshape(-1, 32), np.abs(got - x).reshape(-1, 32)
    amax, span = np.abs(blocks).max(1), blocks.max(1) - blocks.min(1)
    bound = {  # half a quantization step (+ float16 scale rounding); Q4_0 loses one step at the clipped extreme
        Q.Q8_0: 0.55 * amax / 127,
        Q.Q4_0: 1.01 * amax / 8,
        Q.Q4_1: 0.55 * span / 15 + 1e-3 * amax,
        Q.BF16: amax * 2.0**-8,
    }[qt]
    assert np.all(err <= bound[:, None] + 1e-7), float((err - bound[:, None]).max())


def test_metadata_parser_matches_gguf_reader(tmp_path):
    meta = {
        "t.u8": (200, VT.UINT8),
        "t.i8": (-5, VT.INT8),
        "t.u16": (60000, VT.UINT16),
        "t.i16": (-300, VT.INT16),
        "t.u32": (4_000_000_000, VT.UINT32),
        "t.i32": (-7, VT.INT32),
        "t.f32": (1e-5, VT.FLOAT32),
        "t.bool": (True, VT.BOOL),
        "t.str": ("héllo {{ x }}", VT.STRING),
        "t.u64": (2**40, VT.UINT64),
        "t.i64": (-(2**40), VT.INT64),
        "t.f64": (0.1, VT.FLOAT64),
        "t.ints": ([3, 1, 2], VT.ARRAY, VT.INT32),
        "t.strs": (["a", "", "Ġb c"], VT.ARRAY, VT.STRING),
        "t.floats": ([0.5, -1.25], VT.ARRAY, VT.FLOAT32),
        "t.bools": ([True, False], VT.ARRAY, VT.BOOL),
    }
    path = write_gguf(tmp_path / "m.gguf", "llama", meta, {"a": np.ones((2, 32), np.float32)})
    mine = read_gguf_metadata(path)
    ref = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    assert set(mine) == set(ref)
    for k, v in ref.items():
        assert mine[k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), k
    assert mine["t.f32"] == 1e-5 and mine["t.str"] == "héllo {{ x }}" and mine["t.strs"] == ["a", "", "Ġb c"]


# ------------------------------------------------------------------------------------------ SmolLM2
