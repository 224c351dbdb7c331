"""llama.cpp's GGML block formats kept quantized in memory: the table of the types this runtime reads as they are
(values and bytes per block) and their jnp de-quantization, the reference every quantized matmul kernel is tested
against and the path for the products no kernel takes (many rows, other backends).

A weight [N, K] in one of these formats is the raw bytes of the GGUF tensor: uint8 [N, row_bytes], each row K / QK
consecutive blocks (row_bytes = K / QK * BLOCK_BYTES), exactly as llama.cpp stores and reads it. Layouts follow
ggml-common.h (fp16 fields little-endian IEEE half); `gguf.quants.dequantize` is the numpy ground truth the tests
compare this module with.

Interleaved layouts (`interleave_rows`; Q4_K_X16 and Q6_K_X16, made at load for the CPU int8 kernel): the same
values in the same size, each group of 16 consecutive rows' blocks side by side (netra_jax/ops/ggml_blocks.h describes
the bytes), still uint8 [N, row_bytes] but read in groups of 16 rows: a slice of whole groups is a weight of that
layout, a single row is not. They are this runtime's, not GGUF types (type numbers 1000 + the GGUF type's)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = [
    "FORMATS",
    "GGUF_TYPES",
    "SYMMETRIC",
    "BlockFormat",
    "deinterleave_rows",
    "dequantize_rows",
    "interleave_rows",
    "interleaved_layout",
    "pack_rows",
    "quantize_rows_q4_0",
    "row_bytes",
    "symmetric_rows",
]


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block type: `qk` values in `block_bytes` bytes; `ggml_type` is its number in GGUF files."""

    name: str
    ggml_type: int
    qk: int
    block_bytes: int
    interleaved: int = 0  # an interleaved layout's rows per group (0: a GGUF type, row by row)
    base: str | None = None  # the GGUF type an interleaved layout holds


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q5_0", 6, 32, 22),
        BlockFormat("Q5_1", 7, 32, 24),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, 256, 144),
        BlockFormat("Q5_K", 13, 256, 176),
        BlockFormat("Q6_K", 14, 256, 210),
        BlockFormat("Q4_K_X16", 1012, 256, 144, interleaved=16, base="Q4_K"),
        BlockFormat("Q6_K_X16", 1014, 256, 210, interleaved=16, base="Q6_K"),
    )
}
GGUF_TYPES = tuple(name for name, f in FORMATS.items() if not f.interleaved)  # the types a GGUF file holds
# GGUF type -> its interleaved layout
_INTERLEAVED = {f.base: name for name, f in FORMATS.items() if f.interleaved}


def interleaved_layout(qtype: str) -> str | None:
    """The interleaved layout of GGUF type `qtype` (`interleave_rows`), or None when it has none."""
    return _INTERLEAVED.get(qtype)


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k values (k a multiple of the format's block)."""
    f = FORMATS[qtype]
    if k % f.qk:
        raise ValueError(f"{qtype} rows hold multiples of {f.qk} values, not {k}")
    return k // f.qk * f.block_bytes


def _f16(b: jax.Array) -> jax.Array:
    """[..., 2] uint8 little-endian IEEE half -> [...] float32."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Low and high 4 bits of each byte, as int32."""
    q = qs.astype(jnp.int32)
    return q & 15, q >> 4


def _bits(qh: jax.Array, n: int) -> jax.Array:
    """[..., n/8] uint8 (little-endian bit order) -> [..., n] int32 of 0/1: bit i of the little-endian integer."""
    q = qh.astype(jnp.int32)[..., :, None]  # [..., bytes, 1]
    return ((q >> jnp.arange(8, dtype=jnp.int32)) & 1).reshape(*qh.shape[:-1], n)


# the symmetric 32-value formats as unsigned integers around an offset: w = d * (q - offset)
SYMMETRIC = {"Q4_0": (4, 8), "Q8_0": (8, 128)}  # name -> (bits, offset)


def _symmetric_ints(b: jax.Array, qtype: str) -> jax.Array:
    """[..., block_bytes] blocks of Q4_0 or Q8_0 -> [..., 32] int32 unsigned values in block order (Q4_0: the 16
    low nibbles, then the 16 high ones; Q8_0: the int8 values plus 128)."""
    if qtype == "Q8_0":
        return b[..., 2:].view(jnp.int8).astype(jnp.int32) + 128
    lo, hi = _nibbles(b[..., 2:])
    return jnp.concatenate([lo, hi], -1)


def _symmetric(qtype: str):
    offset = SYMMETRIC[qtype][1]
    return lambda b: (_symmetric_ints(b, qtype) - offset).astype(jnp.float32) * _f16(b[..., 0:2])[..., None]


def symmetric_rows(data: jax.Array, qtype: str) -> tuple[jax.Array, jax.Array]:
    """Rows of Q4_0 or Q8_0 blocks (uint8 [N, row_bytes]) as their integers and scales: (q [N, K] int32 unsigned,
    d [N, K / 32] float16), w = d * (q - offset) with SYMMETRIC's offset."""
    f = FORMATS[qtype]
    b = data.reshape(data.shape[0], -1, f.block_bytes)  # [N, K / 32, bytes]
    q = _symmetric_ints(b, qtype).reshape(data.shape[0], -1)  # [N, K]
    d = jax.lax.bitcast_convert_type(b[..., 0:2], jnp.float16)  # [N, K / 32]
    return q, d


def _q4_1(b):  # [..., 20]
    lo, hi = _nibbles(b[..., 4:])
    q = jnp.concatenate([lo, hi], -1).astype(jnp.float32)
    return q * _f16(b[..., 0:2])[..., None] + _f16(b[..., 2:4])[..., None]


def _five_bit(qh: jax.Array, qs: jax.Array) -> jax.Array:
    lo, hi = _nibbles(qs)
    return jnp.concatenate([lo, hi], -1) | (_bits(qh, 32) << 4)  # [..., 32] in 0..31


def _q5_0(b):  # [..., 22]
    return (_five_bit(b[..., 2:6], b[..., 6:]) - 16).astype(jnp.float32) * _f16(b[..., 0:2])[..., None]


def _q5_1(b):  # [..., 24]
    q = _five_bit(b[..., 4:8], b[..., 8:]).astype(jnp.float32)
    return q * _f16(b[..., 0:2])[..., None] + _f16(b[..., 2:4])[..., None]


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K block from its 12 bytes: ([..., 8], [..., 8]) int32."""
    s = s.astype(jnp.int32)
    sc = jnp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = jnp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _k_quant_affine(b: jax.Array, q: jax.Array) -> jax.Array:
    """Q4_K / Q5_K: q [..., 8, 32] (sub-block j's 32 values) -> d * sc_j * q - dmin * m_j, [..., 256]."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min_k4(b[..., 4:16])
    y = (d * sc)[..., None] * q.astype(jnp.float32) - (dmin * mn)[..., None]
    return y.reshape(*b.shape[:-1], 256)


def _chunked_nibbles(qs: jax.Array) -> jax.Array:
    """128 bytes in 4 chunks of 32: chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1 -> [..., 8, 32]."""
    lo, hi = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32))
    return jnp.stack([lo, hi], -2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b):  # [..., 144]: d, dmin, scales[12], qs[128]
    return _k_quant_affine(b, _chunked_nibbles(b[..., 16:]))


def _q5_k(b):  # [..., 176]: d, dmin, scales[12], qh[32], qs[128]
    qh = b[..., 16:48].astype(jnp.int32)  # bit 2c of qh[l]: sub-block 2c's fifth bit, bit 2c + 1: sub-block 2c + 1's
    high = ((qh[..., None, :] >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1) << 4  # [..., 8, 32]
    return _k_quant_affine(b, _chunked_nibbles(b[..., 48:]) | high)


def _q6_k_ints(b):  # [..., 210] -> [..., 2, 4, 32] the unsigned 6-bit values in order (value 128 n + 32 k + l)
    ql = b[..., 0:128].astype(jnp.int32).reshape(*b.shape[:-1], 2, 2, 32)  # [half, l // 32 (low / high 32), l]
    qh = b[..., 128:192].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 32)  # [half, 1, l]
    # values of a half, in order: q1 (ql[l] low, qh bits 0-1), q2 (ql[l+32] low, bits 2-3), q3 (ql[l] high, 4-5),
    # q4 (ql[l+32] high, 6-7)
    low = jnp.concatenate([ql & 15, ql >> 4], -2)  # [..., 2, 4, 32]: q1, q2, q3, q4's low bits
    high = (qh >> (2 * jnp.arange(4, dtype=jnp.int32))[:, None]) & 3  # [..., 2, 4, 32]
    return low | (high << 4)


def _q6_k_bytes(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The inverse of `_q6_k_ints`: values [..., 2, 4, 32] -> (ql [..., 128], qh [..., 64]) uint8."""
    low, high = q & 15, q >> 4
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(*q.shape[:-3], 128)
    qh = sum(high[..., k, :] << (2 * k) for k in range(4)).reshape(*q.shape[:-3], 64)
    return ql.astype(jnp.uint8), qh.astype(jnp.uint8)


def _q6_k(b):  # [..., 210]: ql[128], qh[64], int8 scales[16], d
    sc = b[..., 192:208].view(jnp.int8).astype(jnp.float32).reshape(*b.shape[:-1], 2, 8)  # [half, 8]
    d = _f16(b[..., 208:210])[..., None, None, None]
    q = (_q6_k_ints(b) - 32).astype(jnp.float32)
    scale = jnp.repeat(sc.reshape(*sc.shape[:-1], 4, 2), 16, axis=-1)  # [..., 2, 4, 32]: sc[is + 2j], is = l // 16
    return (d * scale * q).reshape(*b.shape[:-1], 256)


_DEQUANT = {
    "Q4_0": _symmetric("Q4_0"),
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _symmetric("Q8_0"),
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize_rows(data: jax.Array, qtype: str, dtype=jnp.float32) -> jax.Array:
    """uint8 [..., row_bytes] rows of `qtype` blocks -> [..., K] de-quantized (K = row_bytes / BLOCK_BYTES * QK).
    An interleaved layout's rows are de-quantized by whole groups (axis -2)."""
    f = FORMATS[qtype]
    if data.dtype != jnp.uint8 or data.shape[-1] % f.block_bytes:
        raise ValueError(f"{qtype} rows are uint8 multiples of {f.block_bytes} bytes, got {data.dtype} {data.shape}")
    if f.interleaved:
        return dequantize_rows(deinterleave_rows(data, qtype), f.base, dtype)
    nb = data.shape[-1] // f.block_bytes
    blocks = data.reshape(*data.shape[:-1], nb, f.block_bytes)
    return _DEQUANT[qtype](blocks).reshape(*data.shape[:-1], nb * f.qk).astype(dtype)


def _groups(data: jax.Array, qtype: str, rows: int) -> tuple[list[int], int, int]:
    """(lead axes, groups, blocks per row) of rows [..., N, row_bytes] read in groups of `rows`; ValueError else."""
    f = FORMATS[qtype]
    if data.dtype != jnp.uint8 or data.ndim < 2 or data.shape[-2] % rows or data.shape[-1] % f.block_bytes:
        raise ValueError(
            f"{qtype} weights in groups of {rows} rows are uint8 [..., N, row_bytes] with N a multiple of {rows} and "
            f"row_bytes of {f.block_bytes}-byte blocks, got {data.dtype} {data.shape}"
        )
    return list(data.shape[:-2]), data.shape[-2] // rows, data.shape[-1] // f.block_bytes


def interleave_rows(data: jax.Array, qtype: str) -> tuple[jax.Array, str]:
    """Rows of a GGUF type [..., N, row_bytes] -> (the same values in its interleaved layout, that layout's name):
    Q4_K -> Q4_K_X16, Q6_K -> Q6_K_X16 (N a multiple of 16; ValueError else). Each group of 16 rows' blocks b lie
    side by side: their scale fields field by field, then their values in 64-byte vectors whose int32 lane r holds
    row r's (the bytes: netra_jax/ops/ggml_blocks.h)."""
    if qtype not in _INTERLEAVED:
        raise ValueError(f"no interleaved layout of {qtype} (those: {', '.join(_INTERLEAVED)})")
    name = _INTERLEAVED[qtype]
    f = FORMATS[name]
    rows = f.interleaved
    lead, g, nb = _groups(data, qtype, rows)
    by_block = jnp.moveaxis(data.reshape(*lead, g, rows, nb, f.block_bytes), -3, -2)  # [..., g, nb, rows, bytes]
    by_field = lambda b, n: jnp.swapaxes(b.reshape(*lead, g, nb, rows, -1, n), -3, -2)  # noqa: E731 [.., field, r, n]
    lanes = lambda v: jnp.moveaxis(v, -4, -2)  # noqa: E731 [..., r, a, b, t] -> [..., a, b, r, t]
    if qtype == "Q4_K":
        v = _chunked_nibbles(by_block[..., 16:]).reshape(*lead, g, nb, rows, 8, 2, 2, 2, 4)  # [.., r, j, h, p, s, t]
        values = lanes((v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, g, nb, rows, 16, 2, 4))
        parts = [by_field(by_block[..., 0:4], 2), by_field(by_block[..., 4:16], 1), values]  # d, dmin; scales
    else:  # Q6_K: d; scales; the values' low nibbles and high 2 bits apart
        v = _q6_k_ints(by_block).reshape(*lead, g, nb, rows, 16, 2, 2, 4)  # [..., r, sub-block, p, half, t]
        low, high = v & 15, v >> 4
        low = lanes((low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, g, nb, rows, 16, 2, 4))
        high = high.reshape(*lead, g, nb, rows, 16, 4, 4)  # [..., r, sub-block, f, t]
        high = jnp.moveaxis(sum(high[..., k, :] << (2 * k) for k in range(4)), -3, -2)  # [..., sub-block, r, t]
        values = jnp.concatenate([low.reshape(*lead, g, nb, 16, 128), high.reshape(*lead, g, nb, 16, 64)], -1)
        parts = [by_field(by_block[..., 208:210], 2), by_field(by_block[..., 192:208], 1), values]
    out = jnp.concatenate([p.astype(jnp.uint8).reshape(*lead, g, nb, -1) for p in parts], -1)
    return out.reshape(data.shape), name


def deinterleave_rows(data: jax.Array, qtype: str) -> jax.Array:
    """The inverse of `interleave_rows`: an interleaved layout's rows [..., N, row_bytes] -> its GGUF type's."""
    f = FORMATS[qtype]
    if not f.interleaved:
        raise ValueError(f"{qtype} is not an interleaved layout")
    rows = f.interleaved
    lead, g, nb = _groups(data, qtype, rows)
    blk = data.reshape(*lead, g, nb, rows * f.block_bytes)
    fields = lambda a, b, n: jnp.swapaxes(blk[..., a * rows : b * rows].reshape(*lead, g, nb, -1, rows, n), -3, -2)  # noqa: E731
    own = lambda a, b, n: fields(a, b, n).reshape(*lead, g, nb, rows, -1)  # noqa: E731 each row's bytes [a, b)
    unlanes = lambda v, *shape: jnp.moveaxis(v, -2, -4).reshape(*lead, g, nb, rows, *shape)  # noqa: E731
    if f.base == "Q4_K":
        packed = blk[..., 16 * rows :].reshape(*lead, g, nb, 16, 2, rows, 4).astype(jnp.int32)  # [.., j h, p, r, t]
        v = unlanes(jnp.stack([packed & 15, packed >> 4], -2).reshape(*lead, g, nb, 16, 2, rows, 8), 4, 2, 32)
        qs = (v[..., 0, :] | (v[..., 1, :] << 4)).astype(jnp.uint8).reshape(*lead, g, nb, rows, 128)
        blocks = jnp.concatenate([own(0, 4, 2), own(4, 16, 1), qs], -1)  # [..., g, nb, rows, 144]
    else:
        values = blk[..., 18 * rows :].reshape(*lead, g, nb, 16, 192).astype(jnp.int32)  # per sub-block: low, high
        low = values[..., :128].reshape(*lead, g, nb, 16, 2, rows, 4)
        low = unlanes(jnp.stack([low & 15, low >> 4], -2).reshape(*lead, g, nb, 16, 2, rows, 8), 16, 16)
        high = values[..., 128:].reshape(*lead, g, nb, 16, rows, 4)  # [..., sub-block, r, t]
        high = jnp.stack([(high >> (2 * k)) & 3 for k in range(4)], -2)  # [..., sub-block, r, f, t]
        high = jnp.moveaxis(high, -3, -4).reshape(*lead, g, nb, rows, 16, 16)  # [..., r, sub-block, 4 f + t]
        ql, qh = _q6_k_bytes((low | (high << 4)).reshape(*lead, g, nb, rows, 2, 4, 32))
        blocks = jnp.concatenate([ql, qh, own(2, 18, 1), own(0, 2, 2)], -1)  # [..., g, nb, rows, 210]
    return jnp.moveaxis(blocks, -2, -3).reshape(data.shape)


def pack_rows(q: jax.Array, d: jax.Array, qtype: str, m: jax.Array | None = None) -> jax.Array:
    """Unsigned integers in GGML blocks: q [..., K] (K a multiple of 32; Q4_0 / Q4_1 values in 0..15, Q8_0's in
    0..255 around 128), d [..., K / 32] float16 scales and, for Q4_1, m [..., K / 32] float16 mins -> uint8
    [..., K / 32 * block_bytes], the blocks `dequantize_rows` reads as d * (q - offset) (SYMMETRIC) or d * q + m."""
    if qtype not in ("Q4_0", "Q4_1", "Q8_0") or (m is None) != (qtype != "Q4_1"):
        raise ValueError(f"pack_rows writes Q4_0 and Q8_0 (scales only) and Q4_1 (scales and mins), not {qtype}")
    k = q.shape[-1]
    if k % 32:
        raise ValueError(f"{qtype} rows hold multiples of 32 values, not {k}")
    lead = q.shape[:-1]
    q = q.astype(jnp.uint8).reshape(*lead, k // 32, 32)  # Q8_0: q - 128 in two's complement is q ^ 128
    if qtype == "Q8_0":
        values = q ^ jnp.uint8(128)
    else:
        values = q[..., :16] | (q[..., 16:] << 4)  # value j in byte j's low nibble, value j + 16 in its high nibble

    def half(v):  # [..., K / 32] -> [..., K / 32, 2] little-endian fp16 bytes
        return jax.lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint8).reshape(*lead, k // 32, 2)

    fields = [half(d)] if m is None else [half(d), half(m)]
    return jnp.concatenate([*fields, values], axis=-1).reshape(*lead, k // 32 * FORMATS[qtype].block_bytes)


def quantize_rows_q4_0(rows: jax.Array) -> jax.Array:
    """float [..., K] (K a multiple of 32) -> Q4_0 blocks uint8 [..., K / 32 * 18], rounded as llama.cpp's reference
    quantizer (and `gguf.quants`) does: per block the value of largest magnitude m, d = m / -8, q = clip(trunc(x / d
    + 8.5), 0, 15); d stored as fp16."""
    k = rows.shape[-1]
    if k % 32:
        raise ValueError(f"Q4_0 rows hold multiples of 32 values, not {k}")
    x = rows.astype(jnp.float32).reshape(*rows.shape[:-1], k // 32, 32)
    m = jnp.take_along_axis(x, jnp.argmax(jnp.abs(x), axis=-1, keepdims=True), axis=-1)  # [..., nb, 1]
    d = m / -8.0
    inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
    q = jnp.clip(jnp.trunc(x * inv + 8.5), 0, 15)  # [..., nb, 32]
    return pack_rows(q.reshape(rows.shape), d[..., 0], "Q4_0")
