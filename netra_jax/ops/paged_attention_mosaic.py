"""Mosaic GPU (Hopper: TMA + wgmma) ragged paged attention: one kernel for decode, prefill, chunked prefill and
mixed batches over the flat token batch, with GQA packing, sliding windows, soft-capping, sinks and split-K.

Design (sm90, bf16/fp16, one warpgroup of 128 threads per program):
- Work items: the flat batch is cut into query blocks of BQ = block_rows // G tokens of one sequence
  (`attention_blocks.block_layout`, shared with the Triton kernel), G = query heads per KV head.
  Grid = (blocks, kv_heads, splits); idle blocks exit at once.
- wgmma M = 64 rows: row r = t * G + g (token t of the block, query head g of the KV group). A block moves
  block_rows of them (64 for prefill: 64 // G tokens x G heads; 8 for decode steps: one token's G <= 8 heads, the
  other rows of the 64 are never loaded and never stored, since rows do not mix in either wgmma). The wrapper
  gathers q into [blocks, kv_heads, block_rows, D] (XLA); a program stores 8 output rows when its tokens fill at
  most 8, and the wrapper gathers each token's rows back (before any split-K merge).
- KV tiles of TILE keys (64 or 128): TILE // page_size pages per tile or TILE-key slices of one page (pages larger
  than TILE), each a TMA copy of a [keys, D] box of one KV head, its page read from the block table, straight from
  the runner's [num_pages, page_size, kv_heads, D] cache (no layout change) into 128-byte-swizzled SMEM;
  `num_stages` tiles in flight: tile j + stages is fetched into tile j's slot once tile j's PV wgmma is done.
- Per tile: S = Q K^T (wgmma, f32 accumulator), soft-cap, causal/window mask by row/column index (only on tiles
  crossing the block's diagonal or its window's edge: a uniform branch), online softmax in base 2, P (bf16/fp16)
  to SMEM, P V (wgmma) added to the f32 accumulator. P goes through SMEM for head_dim <= 128, the path the CPU
  interpreter (whose wgmma takes SMEM operands only) checks; head_dim 256 reads P from registers
  (MosaicConfig.p_in_registers, FA3's way), because through SMEM it spills (see `choose_config`). The interpreter
  runs that configuration with P in SMEM; the register path's numbers are checked by a device run (gpu_check's
  kernels section).
- Split-K (decode with too few programs, head_dim <= 128): each split writes f32 partial outputs and their base-2
  log-sum-exp, merged outside by `attention_blocks.merge_splits`. Sinks (per-head logits in the softmax
  denominator only) are applied outside from the log-sum-exp: out *= sigmoid(lse - sink).
Limits: bf16/fp16 only; head_dim a multiple of 64, at most 256; G <= 64; page_size a multiple of 8 dividing 128 or
a multiple of 128; shared memory <= 220 KiB (the chooser picks tile and stages to fit; lowering checks sm90's 227).
Keys are fetched whole pages (or TILE slices), so slots past a sequence's length or before its window on a fetched
tile reach SMEM and are masked: they must hold finite values (0 x inf would poison P V), as the cache does.
`"auto"` uses this kernel only where these hold (see `supports`), the Triton kernel otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.attention_blocks import (
    LOG2E,
    TARGET_PROGRAMS,
    block_layout,
    gather_block_rows,
    merge_splits,
    token_rows,
)
from netra_jax.ops.gpu_budget import GpuBudget

ROWS = 64  # wgmma M of one warpgroup
_SMALL_ROWS = 8  # rows of one SMEM tile: what a decode block (one token x G <= 8 heads) stores
_MAX_SPLITS = 16
_SMEM_BUDGET = 220 * 1024  # of the 227 KiB an sm90 block may use
_NEG = -1e30  # masked score: finite, so a row whose keys are all masked so far gives no NaN
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GPU_BUDGET = GpuBudget(registers=255, smem_bytes=_SMEM_BUDGET)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Static launch configuration."""

    tile: int  # keys per pipeline step: 64 or 128
    num_stages: int  # KV tiles in flight (TMA pipeline depth), >= 1
    num_splits: int = 1  # split-K partitions of each item's keys, merged by log-sum-exp outside the kernel
    block_rows: int = ROWS  # query rows a block moves in and out: (block_rows // G tokens) x G heads; 8 for decode
    p_in_registers: bool = False  # P V wgmma reads P from registers (FA3's way; GPU only, checked on the device)

    def validate(self, page_size: int, head_dim: int, group: int) -> None:
        if self.tile not in (64, 128):
            raise ValueError(f"MosaicConfig.tile={self.tile} must be 64 or 128")
        if self.block_rows not in (8, 16, 32, 64) or self.block_rows < group:
            raise ValueError(f"MosaicConfig.block_rows={self.block_rows} must be 8, 16, 32 or 64 and >= G={group}")
        if self.num_stages < 1 or self.num_splits < 1:
            raise ValueError(f"num_stages and num_splits must be >= 1, got {self}")
        if self.tile % page_size and page_size % self.tile:
            raise ValueError(f"page_size={page_size} and tile={self.tile}: one must divide the other")
        if smem_bytes(self, head_dim) > _SMEM_BUDGET:
            raise ValueError(f"{self} needs {smem_bytes(self, head_dim)} bytes of shared memory (> {_SMEM_BUDGET})")


def smem_bytes(cfg: MosaicConfig, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program: q rows, K/V stages, probabilities, f32 partial output (split-K), row stats."""
    kv = cfg.num_stages * 2 * cfg.tile * head_dim * itemsize
    o32 = ROWS * head_dim * 4 if cfg.num_splits > 1 else 0
    return (ROWS * head_dim + ROWS * cfg.tile) * itemsize + kv + o32 + ROWS * 4


def supports(q_dtype, kv_dtype, q_heads: int, kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """None if the kernel handles these dtypes and shapes, else the reason it does not."""
    if jnp.dtype(q_dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q_dtype).name} (Mosaic GPU attention takes bfloat16 or float16)"
    if jnp.dtype(kv_dtype) != jnp.dtype(q_dtype):
        return f"a {jnp.dtype(kv_dtype).name} KV cache with {jnp.dtype(q_dtype).name} queries (one dtype for both)"
    if head_dim % 64 or head_dim > 256:
        return f"head_dim={head_dim} (must be a multiple of 64, at most 256)"
    if q_heads % kv_heads or q_heads // kv_heads > ROWS:
        return f"q_heads={q_heads}, kv_heads={kv_heads} (need a whole GQA group of at most {ROWS} heads)"
    if page_size % 8 or (128 % page_size and page_size % 128):
        return f"page_size={page_size} (must be a multiple of 8 dividing 128, or a multiple of 128)"
    return None


def choose_config(
    num_tokens: int, num_seqs: int, group: int, kv_heads: int, head_dim: int, page_size: int, max_context: int
) -> MosaicConfig:
    """Tiles of 128 keys (64 for head_dim 256, to keep two stages and the accumulators in registers), as many
    stages as shared memory allows (<= 4); decode-like steps (about a token per sequence) move 8-row query blocks
    (G rows used, not 64) and split each context when there are too few programs to fill the GPU.

    head_dim 256 feeds P to the P V wgmma from registers: its [64, 256] f32 accumulator takes 128 of a thread's 255
    registers, and with P staged through shared memory every such configuration spilled about 900 bytes (the GPU
    compile check, benchmarks/gpu_compile); from registers they compile to about 240 registers without spills.
    Narrower heads keep the shared-memory path, whose numbers the interpreter checks too."""
    tile = 128 if head_dim <= 128 else 64
    if page_size % tile and tile % page_size:
        tile = 64
    splits, block_rows = 1, ROWS
    decode = num_tokens <= 2 * num_seqs
    if decode:
        block_rows = min(ROWS, 8 * -(-group // 8))
    if decode and head_dim <= 128:
        splits = -(-TARGET_PROGRAMS // max(1, num_seqs * kv_heads))
        splits = max(1, min(splits, _MAX_SPLITS, max_context // (2 * tile)))  # >= two tiles per split
    stages = 4
    while stages > 1 and smem_bytes(MosaicConfig(tile, stages, splits), head_dim) > _SMEM_BUDGET:
        stages -= 1
    return MosaicConfig(
        tile=tile, num_stages=stages, num_splits=splits, block_rows=block_rows, p_in_registers=head_dim > 128
    )


def _transforms(dtype):
    """Tiling + 128-byte swizzle of a [rows, D] SMEM tile, as TMA and wgmma want it."""
    minor = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(128))


def _kernel(
    seq_ref,  # [NB] int32 sequence of each block
    nq_ref,  # [NB] int32 tokens in the block (0: idle)
    pos0_ref,  # [NB] int32 absolute position of the block's first token
    bt_ref,  # [S, max_pages] int32
    q_ref,  # [NB, KH, BR, D] gathered query rows (BR = block_rows)
    k_ref,  # [num_pages, P, KH, D]
    v_ref,  # [num_pages, P, KH, D]
    o_ref,  # [NS, NB, KH, BR, D] q dtype (NS == 1) or f32 partials
    lse_ref,  # [NS, NB, KH, BR] f32 base-2 log-sum-exp of each row's scores
    q_smem,  # [ROWS, D]: rows past BR are never written (their garbage rows are never stored)
    k_smem,  # [stages, TILE, D]
    v_smem,  # [stages, TILE, D]
    p_smem,  # [ROWS, TILE] probabilities (the interpreter's wgmma reads both operands from SMEM)
    o32_smem,  # [ROWS, D] f32 (split-K only, else None)
    lse_smem,  # [ROWS] f32
    q_bar,
    k_bar,  # [stages], one arrival per TMA copy of a tile
    v_bar,
    *,
    group: int,
    cfg: MosaicConfig,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    b, kh = lax.axis_index("block"), lax.axis_index("kv_head")
    split = lax.axis_index("split")
    TILE, NSTAGE, BR = cfg.tile, cfg.num_stages, cfg.block_rows
    D = q_ref.shape[-1]
    P = k_ref.shape[1]
    max_pages = bt_ref.shape[1]
    chunk = min(P, TILE)  # keys per TMA copy
    n_q = nq_ref[b]

    @pl.when(n_q > 0)
    def _():
        seq, pos0 = seq_ref[b], pos0_ref[b]
        kv_hi = pos0 + n_q  # keys [kv_lo, kv_hi) can be visible to this block
        kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
        t_lo, t_hi = kv_lo // TILE, (kv_hi + TILE - 1) // TILE
        if cfg.num_splits > 1:
            per = (t_hi - t_lo + cfg.num_splits - 1) // cfg.num_splits
            t_lo = t_lo + split * per
            t_hi = jnp.minimum(t_lo + per, t_hi)
        n_steps = jnp.maximum(t_hi - t_lo, 0)

        def pages_of(step):
            """Physical pages of tile t_lo + step's TMA boxes (block-table reads; past the table: its last entry)."""
            keys = [(t_lo + step) * TILE + i * chunk for i in range(TILE // chunk)]
            return tuple(bt_ref[seq, jnp.minimum(key // P, max_pages - 1)] for key in keys)

        def fetch(step, slot, pages):
            """TMA copies of tile t_lo + step (TILE // chunk boxes of one KV head) into a pipeline slot."""
            for i, page in enumerate(pages):
                key0 = (t_lo + step) * TILE + i * chunk
                src = (page, pl.ds(key0 % P if chunk < P else 0, chunk), kh)
                dst = (slot, pl.ds(i * chunk, chunk))
                plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[dst], v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[b, kh], q_smem.at[pl.ds(0, BR)], q_bar)
        for s in range(NSTAGE):

            @pl.when(s < n_steps)
            def _(s=s):
                fetch(s, s, pages_of(s))

        plgpu.barrier_wait(q_bar)
        # row r = t * group + g sees key k (relative to the block's first token) iff t >= k (and t < k + window).
        # Tiles from `diag` on hold keys past the first token; tiles before `window_edge` keys before the last
        # token's window: only those are masked, the others are seen whole by every row.
        diag = (pos0 + 1) // TILE
        window_edge = 0 if sliding_window is None else -((sliding_window - pos0 - n_q) // TILE)
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 1, layout=plgpu.Layout.WGMMA)

        def body(j, carry):
            acc, m, den, pages = carry  # [ROWS, D] f32, [ROWS] f32, [ROWS] f32, pages of tile j + NSTAGE
            slot = lax.rem(j, NSTAGE)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, TILE), jnp.float32))  # [ROWS, TILE]
            if soft_cap is None:
                s = s * (scale * LOG2E)
            else:
                s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))

            def mask(s):
                rel = (t_lo + j) * TILE - pos0 + col  # key position relative to the block's first token
                vis = row >= rel * group
                if sliding_window is not None:
                    vis &= row < (rel + sliding_window) * group
                return jnp.where(vis, s, _NEG)

            tile = t_lo + j
            s = lax.cond((tile >= diag) | (tile < window_edge), mask, lambda s: s, s)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            den = den * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if cfg.p_in_registers:
                p16 = p.astype(q_smem.dtype)
                plgpu.barrier_wait(v_bar.at[slot])
                acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[slot]))(plgpu.ACC.init(acc))
            else:
                p_smem[...] = p.astype(p_smem.dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, D), jnp.float32))  # [ROWS, D]

            @pl.when(j + NSTAGE < n_steps)
            def _():
                fetch(j + NSTAGE, slot, pages)

            # the next fetch's block-table reads, issued a whole tile ahead so their latency hides behind it
            return acc, m_new, den, pages_of(j + NSTAGE + 1)

        init = (
            plgpu.layout_cast(jnp.zeros((ROWS, D), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            pages_of(NSTAGE),
        )
        acc, m, den, _ = lax.fori_loop(0, n_steps, body, init)
        den = jnp.maximum(den, 1e-30)  # an empty split: zero output, lse about -1e30 (weight 0 in the merge)
        out = acc / lax.broadcast_in_dim(den, acc.shape, [0])
        lse_smem[...] = m + jnp.log(den) * LOG2E
        o_smem = q_smem if o32_smem is None else o32_smem
        o_smem[...] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        # only rows holding tokens are read back: a block whose tokens fill at most 8 rows stores one 8-row tile
        for n in sorted({_SMALL_ROWS, BR}):
            stored = pl.ds(0, n)
            fits = n_q * group <= _SMALL_ROWS if n == _SMALL_ROWS else n_q * group > _SMALL_ROWS

            @pl.when(fits)
            def _(stored=stored):
                plgpu.copy_smem_to_gmem(o_smem.at[stored], o_ref.at[split, b, kh, stored])

        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, BR)], lse_ref.at[split, b, kh])
        plgpu.wait_smem_to_gmem(0)


def _validate(q, k_pages, v_pages, md, sliding_window, sinks):
    """The shared argument checks, then what this kernel needs (dtype, head_dim, group, page size)."""
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype}, {v_pages.dtype}")
    why = supports(q.dtype, k_pages.dtype, q.shape[1], k_pages.shape[2], q.shape[2], k_pages.shape[1])
    if why is not None:
        raise ValueError(f"the Mosaic GPU attention kernel does not support {why}; use the Triton backend")
    if md.block_tables.ndim != 2 or md.query_start_loc.shape != (md.seq_lens.shape[0] + 1,):
        raise ValueError("metadata shapes: need query_start_loc [S + 1], seq_lens [S], block_tables [S, max_pages]")
    return sinks


def paged_attention_mosaic(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    config: MosaicConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention in one Mosaic GPU kernel; same contract as `attention.paged_attention_reference`.

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; md: AttentionMetadata;
    sinks: optional [q_heads] float32 logits that join each softmax's denominator. Returns [T, q_heads, head_dim] in
    q's dtype, zeros for padding tokens. Softmax statistics and accumulators in float32."""
    sinks = _validate(q, k_pages, v_pages, md, sliding_window, sinks)
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    S, max_pages = md.block_tables.shape
    if config is None:
        config = choose_config(T, S, G, KH, D, P, max_pages * P)
        if interpret:  # the interpreter's wgmma reads both operands from SMEM: the same arithmetic, P staged there
            config = dataclasses.replace(config, p_in_registers=False)
    config.validate(P, D, G)
    if interpret and config.p_in_registers:
        raise ValueError("p_in_registers runs on a GPU only: the interpreter's wgmma reads both operands from SMEM")
    NS, BR = config.num_splits, config.block_rows
    bq = BR // G  # tokens per block
    seq, q_start, n_q, pos0 = block_layout(md.query_start_loc, md.seq_lens, T, bq)
    NB = seq.shape[0]

    rows = gather_block_rows(q, q_start, n_q, KH, BR)  # [NB, KH, BR, D]

    out_dtype = q.dtype if NS == 1 else jnp.float32
    kernel = functools.partial(
        _kernel,
        group=G,
        cfg=config,
        scale=float(scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
    )
    tx = _transforms(q.dtype)
    chunks = config.tile // min(P, config.tile)
    o, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((NS, NB, KH, BR, D), out_dtype),
            jax.ShapeDtypeStruct((NS, NB, KH, BR), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((ROWS, D), q.dtype, transforms=tx),
            plgpu.SMEM((config.num_stages, config.tile, D), q.dtype, transforms=tx),
            plgpu.SMEM((config.num_stages, config.tile, D), q.dtype, transforms=tx),
            plgpu.SMEM((ROWS, config.tile), q.dtype, transforms=tx),
            plgpu.SMEM((ROWS, D), jnp.float32, transforms=_transforms(jnp.float32)) if NS > 1 else None,
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=chunks, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=chunks, num_barriers=config.num_stages),
        ],
        grid=(NB, KH, NS),
        grid_names=("block", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=not interpret),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"ragged_paged_attention_mgpu_r{BR}_t{config.tile}_st{config.num_stages}_s{NS}",
    )(seq, n_q, pos0, md.block_tables.astype(jnp.int32), rows, k_pages, v_pages)

    # each token's rows, gathered before the split merge so that it reads only rows holding tokens (the rows of
    # other tokens and of idle blocks are never written)
    blk, row = token_rows(md.query_start_loc, T, NB, bq, G)
    o = o[:, blk, jnp.arange(KH)[None, :, None], row]  # [NS, T, KH, G, D]
    lse = lse[:, blk, jnp.arange(KH)[None, :, None], row]  # [NS, T, KH, G] base 2
    if NS > 1:
        o = merge_splits(o, lse, jnp.ones_like(lse))  # lse is base 2, as merge_splits' m
        lse_max = jnp.max(lse, axis=0)
        lse = lse_max + jnp.log2(jnp.sum(jnp.exp2(lse - lse_max[None]), axis=0))
    else:
        o, lse = o[0], lse[0]
    if sinks is not None:  # softmax over [scores, sink]: scale by 1 / (1 + exp(sink - lse))
        o = o * jax.nn.sigmoid(lse * math.log(2.0) - sinks.reshape(KH, G)[None])[..., None]
    valid = jnp.arange(T) < md.query_start_loc[-1]  # [T]
    return jnp.where(valid[:, None, None], o.reshape(T, H, D), 0).astype(q.dtype)


def paged_attention_mosaic_interpret(q, k_pages, v_pages, md, **kw) -> jax.Array:
    """The same kernel run by the Mosaic GPU interpreter (CPU tests)."""
    return paged_attention_mosaic(q, k_pages, v_pages, md, interpret=True, **kw)


__all__ = [
    "MosaicConfig",
    "choose_config",
    "paged_attention_mosaic",
    "paged_attention_mosaic_interpret",
    "smem_bytes",
    "supports",
]
