"""Pallas (Triton lowering) ragged paged attention for GPUs: one kernel for decode, prefill, chunked prefill and
mixed batches over the flat token batch, with GQA packing, sliding windows, soft-capping and split-K for decode."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.attention_blocks import LOG2E, TARGET_PROGRAMS, block_layout, merge_splits
from netra_jax.ops.gpu_budget import GpuBudget
from netra_jax.ops.kv_quant import Pages, QuantizedPages, page_operands

_MAX_SPLITS = 64
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_SMEM_BUDGET = 160 * 1024
GPU_BUDGET = GpuBudget(registers=255, smem_bytes=_SMEM_BUDGET)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static launch configuration. Every size is a power of two (a Triton lowering requirement)."""

    block_m: int  # rows per program: (query tokens per block) x (query heads per KV head, padded); >= 16
    tile: int  # keys per inner-loop step; >= 16
    num_splits: int = 1  # split-K partitions of each sequence's context, merged by their log-sum-exp
    num_warps: int = 4
    num_stages: int = 3

    def validate(self, group_padded: int) -> None:
        for name in ("block_m", "tile", "num_splits", "num_warps"):
            if not _is_pow2(getattr(self, name)):
                raise ValueError(f"KernelConfig.{name}={getattr(self, name)} must be a power of two")
        if self.block_m < 16 or self.tile < 16:
            raise ValueError("block_m and tile must be >= 16 (smallest Triton dot)")
        if self.block_m < group_padded:
            raise ValueError(f"block_m={self.block_m} is smaller than the padded GQA group {group_padded}")


def choose_config(
    num_tokens: int,
    num_seqs: int,
    group: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    max_context: int,
    itemsize: int = 2,
    quantized: bool = False,
) -> KernelConfig:
    """Pick a launch configuration from the static shapes of one step.

    Decode-like batches (about one query token per sequence) use 16-row blocks and split the context when there are
    too few (sequence, KV head) programs to fill the GPU; prefill-heavy batches use 64-row blocks and no split.

    Register pressure decides the rest; each rule is what the GPU compile check (benchmarks/gpu_compile) needed for
    no configuration to spill on sm_80 or sm_90a. Key tiles hold 16 KiB of keys for decode blocks and 8 KiB for
    prefill blocks (at head_dim 128 a 64-key prefill tile spilled on sm_80), at most 64 bf16 keys or 32 float32
    keys, and 16 float32 keys in prefill blocks: float32 dots run on FMA units, whose operands and scores take more
    registers (64-key float32 tiles spilled up to 63 KB). A block whose query rows reach 32 KiB runs 8 warps and two
    stages; smaller blocks stay at 4 warps, because ptxas holds 8-warp kernels to 128 registers a thread, where
    the narrower blocks spilled. Over a quantized (int8 / fp8) cache, prefill blocks of float32 queries take 32 rows:
    the scales' multiplies made 64-row blocks spill about 1 KB."""
    gp, dp = _next_pow2(group), _next_pow2(max(head_dim, 16))
    decode = num_tokens <= 2 * num_seqs
    block_m = max(16, gp) if decode else max(32 if quantized and itemsize > 2 else 64, gp)
    warps = 8 if block_m * dp * itemsize >= 32 * 1024 else 4
    key_bytes = 16 * 1024 if decode else 8 * 1024
    tile = max(16, min(64 if itemsize <= 2 else 32, key_bytes // (dp * itemsize)))
    if itemsize > 2 and not decode:
        tile = 16
    splits = 1
    if decode:
        programs = max(1, num_seqs * kv_heads)
        splits = _next_pow2(-(-TARGET_PROGRAMS // programs))
        splits = min(splits, _MAX_SPLITS, _prev_pow2(max_context // (2 * tile)))  # >= two tiles per split
    # software-pipelined K/V tiles live in shared memory (227 KiB per SM on H100/H200); keep a margin
    stages = 3 if warps == 4 else 2
    while stages > 1 and (stages * 2 * tile + block_m) * dp * itemsize > _SMEM_BUDGET:
        stages -= 1
    return KernelConfig(block_m=block_m, tile=tile, num_splits=splits, num_warps=warps, num_stages=stages)


def fp8_bits_to_float(bits: jax.Array, fp8_dtype) -> jax.Array:
    """fp8 values from their uint8 bits as float16, exactly, with integer ops every GPU has: an e5m2 byte is the top
    byte of the float16 of the same value; an e4m3fn byte's exponent and mantissa shifted into a float16 are its value
    times 2^-8 (bias 7 against 15; subnormals included), so the result is multiplied back by 256. e4m3fn's NaN
    (S.1111.111) comes out as 480 (quantization never stores it). bits: uint8 [...] -> float32 [...]."""
    b = bits.astype(jnp.uint16)
    if jnp.dtype(fp8_dtype) == jnp.dtype(jnp.float8_e5m2):
        return lax.bitcast_convert_type(b << 8, jnp.float16).astype(jnp.float32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # sign to bit 15, exponent and mantissa under float16's
    return lax.bitcast_convert_type(h, jnp.float16).astype(jnp.float32) * 256.0


def _kernel(
    seq_ref,  # [NB] int32
    qstart_ref,  # [NB] int32
    nq_ref,  # [NB] int32
    pos0_ref,  # [NB] int32
    bt_ref,  # [S, max_pages] int32
    q_ref,  # [T, H, D]
    k_ref,  # [num_pages, page_size, KH, D] float, or int8 / fp8 with scales
    v_ref,  # [num_pages, page_size, KH, D]
    ks_ref,  # [num_pages, page_size, KH] float32 key scales (quantized pages; else [1, 1, 1], unread)
    vs_ref,  # [num_pages, page_size, KH] float32 value scales
    sinks_ref,  # [H] float32 attention-sink logits (zeros, unread, without sinks)
    *out_refs,  # rows R = [T + block_q, KH, GP]: o [*R, Dp]; split-K: acc [NS, *R, Dp], m, den [NS, *R] (f32)
    group: int,
    group_padded: int,
    head_dim_padded: int,
    cfg: KernelConfig,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    quantized: bool,
    fp8_dtype,
):
    b, kh = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if cfg.num_splits > 1 else 0
    BM, TILE, Dp, GP = cfg.block_m, cfg.tile, head_dim_padded, group_padded
    D = q_ref.shape[2]
    P = k_ref.shape[1]
    max_pages = bt_ref.shape[1]
    n_q = nq_ref[b]

    @pl.when(n_q > 0)
    def _():
        seq, q_start, pos0 = seq_ref[b], qstart_ref[b], pos0_ref[b]
        r = jnp.arange(BM, dtype=jnp.int32)  # [BM] row = token-in-block * GP + head-in-group
        t_in, g = r // GP, r % GP
        row_ok = (t_in < n_q) & (g < group)  # [BM]
        tok = q_start + jnp.where(row_ok, t_in, 0)  # [BM] flat token index (clamped for masked rows' loads)
        head = kh * group + jnp.minimum(g, group - 1)  # [BM]
        d = jnp.arange(Dp, dtype=jnp.int32)  # [Dp]
        d_ok = d < D
        d_idx = jnp.minimum(d, D - 1) if Dp != D else d
        q = plgpu.load(
            q_ref.at[tok[:, None], head[:, None], d_idx[None, :]], mask=row_ok[:, None] & d_ok[None, :], other=0
        )  # [BM, Dp]
        cdt = q.dtype
        prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None
        q_pos = pos0 + t_in  # [BM] absolute position of each row's token

        def widen(tile):  # a loaded K or V tile in the compute dtype, exactly; fp8 pages arrive as their uint8 bits
            if fp8_dtype is None:
                return tile.astype(cdt)
            return fp8_bits_to_float(tile, fp8_dtype).astype(cdt)

        kv_hi = pos0 + n_q  # keys [kv_lo, kv_hi) can be visible to this block
        kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
        t_lo, t_hi = kv_lo // TILE, (kv_hi + TILE - 1) // TILE
        if cfg.num_splits > 1:
            per = (t_hi - t_lo + cfg.num_splits - 1) // cfg.num_splits
            t_lo = t_lo + split * per
            t_hi = jnp.minimum(t_lo + per, t_hi)

        def body(j, carry):
            acc, m, den = carry  # [BM, Dp] f32, [BM] f32, [BM] f32
            kpos = j * TILE + jnp.arange(TILE, dtype=jnp.int32)  # [TILE]
            k_ok = kpos < kv_hi  # also never read keys that no row of the block can see (freed window pages)
            if sliding_window is not None:
                k_ok &= kpos >= kv_lo
            page = bt_ref[seq, jnp.minimum(kpos // P, max_pages - 1)]  # [TILE] physical page of each key
            off = kpos % P
            kv_idx = (page[:, None], off[:, None], kh, d_idx[None, :])
            kv_mask = k_ok[:, None] & d_ok[None, :]
            # quantized pages: int8 / fp8 widen exactly to the compute dtype; each key's scale multiplies its
            # score column and each value's scale its probability column (q . (s k) = s (q . k))
            k = widen(plgpu.load(k_ref.at[kv_idx], mask=kv_mask, other=0))  # [TILE, Dp]
            s = plgpu.dot(q, k, trans_b=True, precision=prec)  # [BM, TILE] f32
            if quantized:
                s = s * plgpu.load(ks_ref.at[page, off, kh], mask=k_ok, other=0.0)[None, :]
            if soft_cap is None:
                s = s * (scale * LOG2E)  # base-2 logits: exp2 is the cheaper instruction
            else:
                s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))
            vis = (kpos[None, :] <= q_pos[:, None]) & k_ok[None, :]  # [BM, TILE]
            if sliding_window is not None:
                vis &= kpos[None, :] > q_pos[:, None] - sliding_window
            s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [BM]
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s - m_safe[:, None])  # [BM, TILE]
            alpha = jnp.exp2(m - m_safe)  # [BM]
            v = widen(plgpu.load(v_ref.at[kv_idx], mask=kv_mask, other=0))  # [TILE, Dp]
            pv = p * plgpu.load(vs_ref.at[page, off, kh], mask=k_ok, other=0.0)[None, :] if quantized else p
            acc = acc * alpha[:, None] + plgpu.dot(pv.astype(cdt), v, precision=prec)
            return acc, m_new, den * alpha + jnp.sum(p, axis=1)

        m0 = jnp.full((BM,), -jnp.inf, jnp.float32)
        den0 = jnp.zeros((BM,), jnp.float32)
        if has_sinks:  # the sink joins the softmax once (in split 0): m = sink, den = exp2(0) = 1
            sink = plgpu.load(sinks_ref.at[head], mask=row_ok, other=0.0) * LOG2E  # [BM] base-2 logit
            first = split == 0
            m0 = jnp.where(first & row_ok, sink, m0)
            den0 = jnp.where(first & row_ok, 1.0, den0)
        init = (jnp.zeros((BM, Dp), jnp.float32), m0, den0)
        acc, m, den = lax.fori_loop(t_lo, t_hi, body, init)
        # Outputs are padded to [T + block_q, KH, GP, Dp] so every row of a block has its own in-bounds address:
        # only the token mask is needed (the interpreter turns masked stores into read-modify-write scatters, which
        # would race on duplicate addresses).
        o_idx = (q_start + t_in[:, None], kh, g[:, None], d[None, :])
        t_ok = (t_in < n_q)[:, None]  # [BM, 1]
        if cfg.num_splits == 1:
            (o_ref,) = out_refs
            out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
            plgpu.store(o_ref.at[o_idx], out.astype(o_ref.dtype), mask=t_ok)
        else:
            acc_ref, m_ref, den_ref = out_refs
            plgpu.store(acc_ref.at[(split, *o_idx)], acc, mask=t_ok)
            plgpu.store(m_ref.at[split, q_start + t_in, kh, g], m, mask=t_in < n_q)
            plgpu.store(den_ref.at[split, q_start + t_in, kh, g], den, mask=t_in < n_q)


def paged_attention_triton(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention in one Pallas kernel; same contract as `attention.paged_attention_reference`.

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim], float or
    `QuantizedPages` (int8 / fp8 tiles widened to q's dtype in the kernel, their scales applied to the scores and
    probabilities); md: AttentionMetadata; sinks: [q_heads] attention-sink logits or None. Returns
    [T, q_heads, head_dim] in q's dtype, zeros for padding tokens. Softmax statistics in float32; f32 inputs use
    full-precision (non-TF32) dots."""
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    G = H // KH
    S, max_pages = md.block_tables.shape
    if config is None:
        quantized = isinstance(k_pages, QuantizedPages)
        config = choose_config(T, S, G, KH, D, P, max_pages * P, jnp.dtype(q.dtype).itemsize, quantized)
    gp = _next_pow2(G)
    config.validate(gp)
    Dp = _next_pow2(max(D, 16))
    seq, q_start, n_q, pos0 = block_layout(md.query_start_loc, md.seq_lens, T, config.block_m // gp)
    NB, NS = seq.shape[0], config.num_splits

    k_op, v_op, k_scales, v_scales = page_operands(k_pages, v_pages)
    fp8 = k_op.dtype if jnp.dtype(k_op.dtype) in _FP8 else None
    if fp8 is not None:
        # fp8 pages go in as their bits, widened in the kernel by `fp8_bits_to_float`: the Triton lowering cannot fill
        # a masked fp8 load's `other`, and has no e4m3 conversion before sm_89
        k_op, v_op = (lax.bitcast_convert_type(x, jnp.uint8) for x in (k_op, v_op))
    kernel = functools.partial(
        _kernel,
        group=G,
        group_padded=gp,
        head_dim_padded=Dp,
        cfg=config,
        scale=float(scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        has_sinks=sinks is not None,
        quantized=isinstance(k_pages, QuantizedPages),
        fp8_dtype=fp8,
    )
    rows = (T + config.block_m // gp, KH, gp)  # padded output rows, see the kernel's store
    if NS == 1:
        out_shape = jax.ShapeDtypeStruct((*rows, Dp), q.dtype)
        grid = (NB, KH)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((NS, *rows, Dp), jnp.float32),
            jax.ShapeDtypeStruct((NS, *rows), jnp.float32),
            jax.ShapeDtypeStruct((NS, *rows), jnp.float32),
        )
        grid = (NB, KH, NS)
    res = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"ragged_paged_attention_m{config.block_m}_t{config.tile}_s{NS}",
    )(
        seq,
        q_start,
        n_q,
        pos0,
        md.block_tables.astype(jnp.int32),
        q,
        k_op,
        v_op,
        k_scales,
        v_scales,
        jnp.zeros((H,), jnp.float32) if sinks is None else sinks,
    )
    out = res if NS == 1 else merge_splits(*res)
    out = out[:T, :, :G, :D].reshape(T, H, D)
    valid = jnp.arange(T, dtype=jnp.int32) < md.query_start_loc[-1]  # [T] rows past the batch were never written
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def paged_attention_triton_interpret(q, k_pages, v_pages, md, **kw) -> jax.Array:
    """The same kernel run by the Pallas interpreter (CPU tests)."""
    return paged_attention_triton(q, k_pages, v_pages, md, interpret=True, **kw)


def attention_flops_bytes(q_lens, seq_lens, q_heads: int, kv_heads: int, head_dim: int, itemsize: int):
    """Useful work of one call for roofline numbers: (FLOPs of QK^T and PV over visible pairs, bytes of K/V read
    once per sequence plus q and output). q_lens, seq_lens: host sequences of ints."""
    pairs = 0
    kv_tokens = 0
    for ql, sl in zip(q_lens, seq_lens, strict=True):
        ctx = sl - ql
        pairs += ql * ctx + ql * (ql + 1) // 2
        kv_tokens += sl
    flops = 4 * pairs * q_heads * head_dim
    nbytes = (2 * kv_tokens * kv_heads + 2 * sum(q_lens) * q_heads) * head_dim * itemsize
    return flops, nbytes


__all__ = [
    "KernelConfig",
    "attention_flops_bytes",
    "fp8_bits_to_float",
    "choose_config",
    "paged_attention_triton",
    "paged_attention_triton_interpret",
]
