"""GGUF block layouts: every GGML type the loader de-quantizes, encoded here from ggml's definitions and de-quantized
through a GGUF file (IQ grid types: test_gguf_quants_iq.py; MXFP4: test_gguf_quants_mxfp4.py; a mixed-type model:
test_gguf_quants_model.py), gguf-py's own quantizer round trip, a refused type, and the header parser against
gguf-py's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from gguf.constants import GGML_QUANT_SIZES
from support.gguf_blocks import ENCODERS, check_through_gguf, write_gguf

from netra_jax.loader import CheckpointError, gguf_loader, read_gguf_metadata
from netra_jax.loader.gguf_loader import GGUFFile

RNG = np.random.default_rng(0)


def test_dequantize_each_type_through_a_gguf_file(tmp_path):
    rows, cols = 3, 512
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated bfloat16 bits
    extra = {
        "w_F32": (x, x),
        "w_F16": (x.astype(np.float16), x.astype(np.float16).astype(np.float32)),
        "w_BF16": ((bf.view(np.uint8).reshape(rows, -1), Q.BF16), (bf.astype(np.uint32) << 16).view(np.float32)),
    }
    check_through_gguf(tmp_path / "q.gguf", ENCODERS, rows, cols, extra)


@pytest.mark.skipif(not hasattr(Q, "Q1_0") or Q.Q1_0 not in GGML_QUANT_SIZES, reason="gguf without Q1_0")
def test_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path):
    if hasattr(gguf.quants, "Q1_0"):
        pytest.skip("this gguf version de-quantizes Q1_0")
    path = write_gguf(tmp_path / "q1.gguf", "llama", {}, {"w": (np.zeros((2, 18), np.uint8), Q.Q1_0)})
    with pytest.raises(CheckpointError, match=r"q1\.gguf: tensor 'w' has GGML type Q1_0.*cannot de-quantize"):
        GGUFFile(path).tensor("w")


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
