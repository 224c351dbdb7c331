"""The "cpu" attention backend: the jnp reference with its per-token rows (and short sequences' prompts) on the C++
kernel of `netra_jax.ops.cpu_attention`; and "cpu_invariant", every token on that kernel (batch-invariant)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_attention, cpu_kernels
from netra_jax.ops.attention.metadata import AttentionMetadata, AttentionWork, with_token_layout
from netra_jax.ops.attention.reference import attend_by_work, paged_attention_reference
from netra_jax.ops.kv_quant import Pages


def _kernel_token_path(out, q, k_pages, v_pages, lay, idx, count, *, scale, sliding_window, soft_cap, sinks):
    """`_token_path` on the C++ kernel (`netra_jax.ops.cpu_attention`): out [T, H, D] holds zeros and is replaced."""
    return cpu_attention.token_attention(
        q,
        k_pages,
        v_pages,
        idx,
        count,
        lay.q_pos,
        lay.valid,
        lay.rows,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
    ).astype(out.dtype)


def paged_attention_cpu(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`paged_attention_reference` with its per-token rows on the C++ kernel of `netra_jax.ops.cpu_attention`, for
    float32 queries and pages when the kernels are built (else the reference itself). The kernel takes the reference's
    per-token rows (decodes, speculative runs) and every token of a sequence whose context is at most
    `CPU_TOKEN_CONTEXT` keys (its keys stay in cache for its whole prompt chunk); query blocks of longer sequences
    keep the jnp block path, which shares each gathered chunk of keys between 32 queries. Which path a token takes
    depends on its own sequence only, so a request's result does not depend on its batch. Same arguments and result
    as the reference, up to float rounding; lowers for CPU only."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if not (cpu_attention.takes(q, k_pages) and cpu_kernels.available()):
        return paged_attention_reference(q, k_pages, v_pages, md, **kw)
    if md.work is not None:
        md = md.replace(work=_short_runs_per_token(with_token_layout(md, q.shape[0]), CPU_TOKEN_CONTEXT))
    return attend_by_work(q, k_pages, v_pages, md, _kernel_token_path, **kw)


def paged_attention_cpu_invariant(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The batch-invariant "cpu_invariant" backend: every token on the C++ per-token kernel, whatever its sequence's
    length, so a token's result depends on its query, its position and its keys alone (its keys are walked in order
    of position in fixed 1024-position parts): the same in any batch, in a prefill chunk of any size, after a
    prefix-cache hit or recomputed after preemption. float32 or bfloat16 queries (widened to float32; the result in
    q's dtype) over float32, bfloat16 or quantized pages. Same arguments and result as the reference, up to float
    rounding; ValueError when the kernels are not available or the pages' dtype is not one the kernel reads. Lowers
    for CPU only. (Longer prompts cost more than on "cpu", which shares gathered keys between a block's queries.)"""
    if q.dtype not in (jnp.float32, jnp.bfloat16) or not cpu_attention.reads_pages(k_pages):
        raise ValueError(
            "attention_backend 'cpu_invariant' takes float32 or bfloat16 queries over float32, bfloat16, int8 or fp8 "
            f"pages; got {q.dtype} queries and {k_pages.dtype} pages"
        )
    if not cpu_kernels.available():
        raise ValueError(f"attention_backend 'cpu_invariant' needs the CPU kernels: {cpu_kernels.unavailable_reason()}")
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    out = attend_by_work(q.astype(jnp.float32), k_pages, v_pages, md.replace(work=None), _kernel_token_path, **kw)
    return out.astype(q.dtype)


# The "cpu" backend's kernel takes every token of sequences with at most this context. Measured on SmolLM2 (2-core
# Xeon), a prompt's prefill step with its attention on the kernel against the block path: 128 tokens 160 against
# 189 ms, 256 tokens 296 against 322; 384 tokens 554 against 546, 1000 tokens 1656 against 1339.
CPU_TOKEN_CONTEXT = 256


def _short_runs_per_token(md: AttentionMetadata, limit: int) -> AttentionWork:
    """md's work lists with every token of the sequences of at most `limit` keys moved to the per-token list (their
    query blocks emptied, the remaining blocks first)."""
    w, lay = md.work, md.layout
    T = lay.valid.shape[0]
    short = md.seq_lens <= limit  # [S]
    take = jnp.zeros(T, bool).at[w.tokens].set(True, mode="drop") | (lay.valid & short[lay.seq_idx])  # [T]
    (tokens,) = jnp.nonzero(take, size=T, fill_value=T)  # [T], in token order
    kept = (w.item_len > 0) & ~short[w.item_seq]  # [N] blocks of long sequences
    order = jnp.argsort(~kept, stable=True)  # kept blocks first
    return AttentionWork(
        tokens=tokens.astype(jnp.int32),
        num_tokens=take.sum().astype(jnp.int32),
        item_start=w.item_start[order],
        item_len=jnp.where(kept, w.item_len, 0)[order],
        item_seq=w.item_seq[order],
        num_items=kept.sum().astype(jnp.int32),
    )


def cpu_backend() -> str:
    """The backend "auto" runs on CPU: "cpu" (the reference with its per-token rows on the C++ kernel) when the
    kernels build, else "reference"."""
    return "cpu" if cpu_kernels.available() else "reference"
