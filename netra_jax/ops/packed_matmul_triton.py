"""Pallas (Triton lowering) W4A16 / W8A16 matmul on GPUs: x [M, K] times a grouped integer weight (the layout of
`quant.weights.PackedIntWeight`) de-quantized tile by tile in registers, so a step reads the packed bytes only.

Layout: grid = (cdiv(M, BM), cdiv(N, BN)); each program accumulates its [BM, BN] tile in float32 over K in BK steps.
A step loads the [BK / per, BN] words holding its BK input rows once (per = 32 / bits values a word), shifts and
masks the per values out of each in registers ([BK / per, per, BN], then [BK, BN]: row k is value k % per of word
k // per), gathers each row's scale (and zero point) row by its group (k // group, or g_idx[k] for GPTQ act-order
weights: taken here, no permutation of x or of the weight), de-quantizes (q - zero) * scale in the scale's dtype
(the reference's arithmetic) and multiplies in x's dtype. Works on sm80 and sm90 (Triton's lowering picks mma or wgmma).

No Mosaic GPU version: decode (M <= 64) reads each weight byte once and is bandwidth-bound, where this kernel's
loads already are the packed bytes; wgmma would need the de-quantized tile stored to shared memory first (its B
operand lives there) and pays only for prefill-sized M, which is compute-bound on either kernel."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from netra_jax.ops.gpu_budget import GpuBudget

GPU_BUDGET = GpuBudget(registers=255, smem_bytes=160 * 1024)
BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class PackedMatmulConfig:
    """Static launch configuration; every block size a power of two >= 16 (Triton's)."""

    block_m: int  # rows of x per program
    block_n: int  # output columns per program
    block_k: int  # contraction step
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < (1 if name == "num_warps" else 16) or v & (v - 1):
                raise ValueError(f"PackedMatmulConfig.{name}={v} must be a power of two (>= 16)")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_config(m: int, k: int, n: int, itemsize: int = 2) -> PackedMatmulConfig:
    """16-row blocks up to 64 (decode steps have a few rows: one block). 16-row blocks: 64-wide column tiles (more
    programs for a bandwidth-bound product: 64 for N = 4096 on 132 SMs, against 32 of 128 wide), 128 deep; more
    rows: 128 x 32 tiles; float32 (dots on FMA units): 64 x 32, and 32 x 32 for more than 16 rows. Each step holds
    [K step, N tile] values, scales and zero points: 64 x 128 x 64 tiles spilled registers on sm_80 and sm_90a (GPU
    compile check)."""
    block_m = min(64, max(16, _pow2(m)))
    bf16 = itemsize <= 2
    wide = 128 if bf16 else 32  # the column tile of blocks of more than 16 rows
    block_n = min(64 if block_m <= 16 else wide, max(16, _pow2(n)))
    block_k = min(128 if bf16 and block_m <= 16 else 32, max(16, _pow2(k)))
    return PackedMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k)


def _kernel(*refs, bits: int, group: int, has_zero: bool, has_g_idx: bool, cfg: PackedMatmulConfig):
    """One [BM, BN] output tile. refs: x [M, K], packed [K / per, N] int32, scale [K / group, N], then zero
    [K / group, N] int32 and g_idx [K] int32 when given, and the output [cdiv(M, BM) * BM, cdiv(N, BN) * BN] (padded
    so that every lane of a store has its own address: the interpreter turns masked stores into read-modify-write
    scatters, which would race on the clamped addresses)."""
    x_ref, packed_ref, scale_ref, *rest = refs
    zero_ref = rest.pop(0) if has_zero else None
    g_idx_ref = rest.pop(0) if has_g_idx else None
    (o_ref,) = rest
    i, j = pl.program_id(0), pl.program_id(1)
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    M, K = x_ref.shape
    KW, N = packed_ref.shape
    per = 32 // bits
    rows = i * BM + jnp.arange(BM, dtype=jnp.int32)  # [BM]
    row_ok = rows < M
    rows_c = jnp.minimum(rows, M - 1)  # clamped for the masked lanes' addresses
    cols = j * BN + jnp.arange(BN, dtype=jnp.int32)  # [BN]
    cols_c = jnp.minimum(cols, N - 1)  # the padded columns read column N - 1, their output is sliced off
    prec = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def step(kk, acc):
        ks = kk * BK + jnp.arange(BK, dtype=jnp.int32)  # [BK]
        k_ok = ks < K
        ks_c = jnp.minimum(ks, K - 1)
        x = plgpu.load(x_ref.at[rows_c[:, None], ks_c[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        wi = jnp.minimum(kk * (BK // per) + jnp.arange(BK // per, dtype=jnp.int32), KW - 1)  # [BK / per] word rows
        words = plgpu.load(packed_ref.at[wi[:, None], cols_c[None, :]])  # [BK / per, BN] int32, each word once
        shifts = jnp.arange(per, dtype=jnp.int32) * bits  # [per]
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [BK / per, per, BN]
        q = q.reshape(BK, BN)  # unsigned values, row k = word k // per, value k % per
        g = plgpu.load(g_idx_ref.at[ks_c]) if has_g_idx else ks_c // group  # [BK] each row's group
        scale = plgpu.load(scale_ref.at[g[:, None], cols_c[None, :]])  # [BK, BN]
        zero = plgpu.load(zero_ref.at[g[:, None], cols_c[None, :]]) if has_zero else 1 << (bits - 1)
        w = (q - zero).astype(scale.dtype) * scale  # [BK, BN]
        w = jnp.where(k_ok[:, None], w, 0).astype(x.dtype)  # rows past K: x is 0 there, w must not be NaN
        return acc + plgpu.dot(x, w, precision=prec)  # [BM, BN] f32

    acc = lax.fori_loop(0, pl.cdiv(K, BK), step, jnp.zeros((BM, BN), jnp.float32))
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype))


def check_args(x: jax.Array, packed, scale, zero, g_idx, bits: int, group: int) -> None:
    """ValueError naming the argument whose shape or type does not fit the others."""
    if bits not in BITS:
        raise ValueError(f"packed matmul: bits={bits}, supported: {BITS}")
    if x.ndim != 2:
        raise ValueError(f"packed matmul: x must be [M, K], got shape {x.shape}")
    M, K = x.shape
    per = 32 // bits
    if packed.dtype != jnp.int32 or packed.shape[0] * per != K:
        raise ValueError(f"packed matmul: packed {packed.shape} {packed.dtype} does not hold K={K} {bits}-bit rows")
    N = packed.shape[1]
    groups = scale.shape[0]
    if scale.shape[1] != N or (g_idx is None and groups * group != K):
        raise ValueError(f"packed matmul: scale {scale.shape} does not fit K={K}, N={N}, group={group}")
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"packed matmul: zero {zero.shape} must have the scale's shape {scale.shape}")
    if g_idx is not None and g_idx.shape != (K,):
        raise ValueError(f"packed matmul: g_idx {g_idx.shape} must be [K={K}]")


def packed_matmul_triton(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None = None,
    g_idx: jax.Array | None = None,
    *,
    bits: int,
    group: int,
    out_dtype=None,
    config: PackedMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] (bf16, f16 or f32) @ W -> [M, N] in out_dtype (x's dtype when None), accumulated in float32, where
    W[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n] is `quant.weights.PackedIntWeight`'s de-quantization (q
    unsigned `bits`-bit values packed along K into int32 words: packed [K * bits / 32, N]; zero None = 2^(bits-1);
    g(k) = k // group, or g_idx[k])."""
    check_args(x, packed, scale, zero, g_idx, bits, group)
    M, K = x.shape
    N = packed.shape[1]
    if config is None:
        config = choose_config(M, K, N, jnp.dtype(x.dtype).itemsize)
    config.validate()
    m_tiles, n_tiles = pl.cdiv(M, config.block_m), pl.cdiv(N, config.block_n)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    extra = [a.astype(jnp.int32) for a in (zero, g_idx) if a is not None]
    kernel = functools.partial(
        _kernel, bits=bits, group=group, has_zero=zero is not None, has_g_idx=g_idx is not None, cfg=config
    )
    c = config
    out = pl.pallas_call(
        kernel,
        grid=(m_tiles, n_tiles),
        out_shape=jax.ShapeDtypeStruct((m_tiles * c.block_m, n_tiles * c.block_n), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
        name=f"packed_matmul_w{bits}_m{c.block_m}_n{c.block_n}_k{c.block_k}",
    )(x, packed, scale, *extra)
    return out[:M, :N]


def packed_matmul_triton_interpret(x, packed, scale, zero=None, g_idx=None, **kw) -> jax.Array:
    """The same kernel run by the Pallas interpreter (CPU tests)."""
    return packed_matmul_triton(x, packed, scale, zero, g_idx, interpret=True, **kw)


def packed_matmul_reference(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """The plain-jnp contract for a `quant.weights.PackedIntWeight` w of 2-D shape: its jnp de-quantization (the
    ground truth) times x, in float32 at full precision, cast to out_dtype (x's dtype when None)."""
    wf = w.dequantize().astype(jnp.float32)  # [K, N]
    y = jnp.dot(x.astype(jnp.float32), wf, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


__all__ = [
    "BITS",
    "GPU_BUDGET",
    "PackedMatmulConfig",
    "check_args",
    "choose_config",
    "packed_matmul_reference",
    "packed_matmul_triton",
    "packed_matmul_triton_interpret",
]
