"""Embedding forward: whole prompts packed as one flat ragged batch (the runner's step layout, padded to a token
bucket), run through the model's decoder stack on a scratch paged KV cache, and pooled on device (last token, mean
or first token of each sequence) into float32 vectors; every bucket is compiled at warm-up, none per request."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax import parallel
from netra_jax.config import ModelConfig
from netra_jax.engine.runner import ModelRunner, token_buckets
from netra_jax.engine.step_layout import BatchShape, layout_buffer, unpack
from netra_jax.models.transformer import hidden_states, init_kv_cache

__all__ = ["Embedder", "pack_prompts"]


def pack_prompts(prompts: list[list[int]], shape: BatchShape, page_size: int, pad_slot: int) -> np.ndarray:
    """Whole prompts as one packed step array: sequence s at positions 0.. on its own consecutive pages of a
    scratch cache (pages of earlier sequences first). [shape.packed_len()] int32"""
    buf, lay = layout_buffer(shape, [len(p) for p in prompts], pad_slot)
    tok, pos, slot = (lay.view(buf, k) for k in ("tokens", "positions", "slots"))
    qsl, seq_lens, last = (lay.view(buf, k) for k in ("query_start_loc", "seq_lens", "logits_idx"))
    tables = lay.view(buf, "block_tables").reshape(shape.num_seqs, shape.max_pages)
    t = first_page = 0
    for s, ids in enumerate(prompts):
        n, pages = len(ids), -(-len(ids) // page_size)
        tok[t : t + n] = ids
        pos[t : t + n] = np.arange(n)
        slot[t : t + n] = first_page * page_size + np.arange(n)  # consecutive pages: slots are consecutive too
        tables[s, :pages] = np.arange(first_page, first_page + pages)
        seq_lens[s] = n
        t += n
        qsl[s + 1] = t
        last[s] = t - 1
        first_page += pages
    qsl[len(prompts) + 1 :] = t
    return buf


def _pool_step(
    params,
    packed,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    pooling: str,
    num_pages: int,
    page_size: int,
    backend,
    mesh,
    matmul_backend,
):
    """Pooled final hidden states of the packed prompts: [S, hidden] float32 (padding rows are garbage)."""
    x = unpack(packed, shape)
    kv_sharding = None if mesh is None else parallel.kv_sharding(mesh)
    kv = init_kv_cache(cfg, num_pages, page_size, params["embed"].dtype, sharding=kv_sharding)  # scratch
    qsl = x.md.query_start_loc  # [S + 1]
    rows = {"LAST": x.logits_idx, "CLS": qsl[:-1], "MEAN": None}[pooling]  # [S] or every token
    h, _ = hidden_states(
        params, cfg, x.tokens, x.positions, kv, x.md, rows, backend=backend, mesh=mesh, matmul_backend=matmul_backend
    )
    h = h.astype(jnp.float32)  # [S or T, hidden]
    if pooling != "MEAN":
        return h
    t = jnp.arange(shape.num_tokens)  # an unrolled binary search: no while loop (see ops.attention_blocks.token_rows)
    seq = jnp.searchsorted(qsl[1:], t, side="right", method="scan_unrolled")  # [T]: its sequence (S: padding)
    sums = jax.ops.segment_sum(h, seq, num_segments=shape.num_seqs)  # [S, hidden]
    return sums / jnp.maximum(x.md.seq_lens, 1).astype(jnp.float32)[:, None]


class Embedder:
    """Pooled embeddings of whole prompts on the runner's parameters (the runner's KV pages are not touched: each
    call attends over a scratch cache of its own). A prompt is never split (no chunking), so the largest bucket
    covers `max_tokens` >= the model's context; prompts are grouped into batches of at most that many tokens and the
    runner's sequence bucket. One compiled variant per token bucket (from one page up: tiny prompts pad to a page),
    all built by `warmup`."""

    def __init__(self, runner: ModelRunner, pooling_type: str, max_tokens: int) -> None:
        self.runner = runner
        self.pooling_type = pooling_type
        self.page_size = runner.page_size
        self.max_seqs = runner.max_seqs_bucket
        most = max(max_tokens, runner.max_pages * runner.page_size)  # at least one whole context
        self.buckets = tuple(b for b in token_buckets(most) if b >= min(most, self.page_size))
        self._jit = jax.jit(
            functools.partial(_pool_step, mesh=runner.mesh, matmul_backend=runner.matmul_backend),
            static_argnames=("cfg", "shape", "pooling", "num_pages", "page_size", "backend"),
        )
        self.num_calls = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def shape_for(self, num_tokens: int) -> BatchShape:
        T = next((b for b in self.buckets if b >= num_tokens), None)
        if T is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest embedding bucket {self.max_tokens}")
        return BatchShape(T, min(T, self.max_seqs), self.runner.max_pages)

    def num_pages(self, shape: BatchShape) -> int:
        """Scratch pages of a step: its tokens' pages plus one partial page per sequence."""
        return shape.num_tokens // self.page_size + shape.num_seqs

    def batches(self, prompts: list[list[int]]) -> list[range]:
        """Consecutive groups of prompts that fit one step (tokens and sequences)."""
        longest = self.runner.max_pages * self.page_size  # a block table's reach (>= the model's context)
        out, start, tokens = [], 0, 0
        for i, ids in enumerate(prompts):
            if len(ids) > longest:
                raise ValueError(f"a prompt of {len(ids)} tokens exceeds the model's context ({longest} tokens)")
            if i > start and (tokens + len(ids) > self.max_tokens or i - start == self.max_seqs):
                out.append(range(start, i))
                start, tokens = i, 0
            tokens += len(ids)
        if start < len(prompts):
            out.append(range(start, len(prompts)))
        return out

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """Pooled (not yet normalized) embeddings of the prompts, in order: [len(prompts), hidden] float32. Every
        batch is dispatched before the first is read, so the host packs while the device computes."""
        pending = []
        for group in self.batches(prompts):
            batch = [prompts[i] for i in group]
            pending.append((len(batch), self._dispatch(batch, self.shape_for(sum(map(len, batch))))))
        hidden = self.runner.cfg.hidden_size
        rows = [np.asarray(out)[:n] for n, out in pending]  # host reads: slicing on device would compile
        return np.concatenate(rows) if rows else np.zeros((0, hidden), np.float32)

    def _dispatch(self, prompts: list[list[int]], shape: BatchShape) -> jax.Array:
        pages = self.num_pages(shape)
        packed = pack_prompts(prompts, shape, self.page_size, pages * self.page_size)
        self.num_calls += 1
        return self._jit(
            self.runner.params,
            packed,
            cfg=self.runner.cfg,
            shape=shape,
            pooling=self.pooling_type,
            num_pages=pages,
            page_size=self.page_size,
            backend=self.runner.backend,
        )  # packed: numpy, moved by the call (one host->device copy)

    def warmup(self) -> float:
        """Compile (and run once on an all-padding batch) every bucket's variant; returns seconds spent."""
        t0 = time.perf_counter()
        for T in self.buckets:
            jax.block_until_ready(self._dispatch([], self.shape_for(T)))
        return time.perf_counter() - t0

    def __repr__(self) -> str:
        return f"Embedder({self.pooling_type}, buckets up to {self.max_tokens} tokens, {self.max_seqs} sequences)"
