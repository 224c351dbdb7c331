"""Model runner: packs a SchedulerOutput into one flat ragged token batch padded to a token bucket, ships its
metadata as a single host array, runs the jitted forward over the donated paged KV cache, and samples on device."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax import parallel
from netra_jax.config import CacheConfig, ModelConfig
from netra_jax.engine.scheduler import SchedulerOutput
from netra_jax.models.transformer import forward, init_kv_cache
from netra_jax.ops.attention import AttentionMetadata, AttentionWork, build_work, num_items

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first one covering `max_tokens`, with 1.5x steps between them from 512 on
    (prefill steps are large: this caps their padding at a third instead of a half); the last capped to
    `max_tokens`."""
    out, b = [], 1
    while b < max_tokens:
        out.append(b)
        if b >= 512 and b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_tokens)
    return tuple(out)


@dataclass(frozen=True)
class BatchShape:
    """Static shape of one compiled step variant."""

    num_tokens: int  # T
    num_seqs: int  # S (logit rows)
    max_pages: int  # W (block-table width)

    @property
    def num_items(self) -> int:
        return num_items(self.num_tokens, self.num_seqs)

    def packed_len(self) -> int:
        T, S, W, N = self.num_tokens, self.num_seqs, self.max_pages, self.num_items
        return 3 * T + (S + 1) + 2 * S + S * W + (T + 1) + (3 * N + 1)


@dataclass
class PackedBatch:
    shape: BatchShape
    host: np.ndarray  # [packed_len] int32: tokens | positions | slots | qsl | seq_lens | logits_idx | block_tables |
    #                   attention work lists (per-token tokens, count | item starts, lengths, seqs, count)
    num_seqs: int  # real sequences
    num_tokens: int  # real tokens


def pack_batch(out: SchedulerOutput, shape: BatchShape, page_size: int, pad_slot: int) -> PackedBatch:
    """Lay the scheduled requests out as one flat token batch in a single int32 array (one host->device copy)."""
    T, S, W = shape.num_tokens, shape.num_seqs, shape.max_pages
    buf = np.zeros(shape.packed_len(), np.int32)
    tok, pos, slot = buf[:T], buf[T : 2 * T], buf[2 * T : 3 * T]
    o = 3 * T
    qsl = buf[o : o + S + 1]
    seq_lens = buf[o + S + 1 : o + 2 * S + 1]
    lidx = buf[o + 2 * S + 1 : o + 3 * S + 1]
    bt = buf[o + 3 * S + 1 : o + 3 * S + 1 + S * W].reshape(S, W)
    slot[:] = pad_slot
    t = 0
    for s, sr in enumerate(out.scheduled):
        n, start = sr.num_new_tokens, sr.start
        tok[t : t + n] = sr.token_ids
        p = np.arange(start, start + n, dtype=np.int32)
        pos[t : t + n] = p
        blocks = np.asarray(sr.block_ids, np.int32)
        slot[t : t + n] = blocks[p // page_size] * page_size + p % page_size
        bt[s, : len(blocks)] = blocks
        seq_lens[s] = start + n
        t += n
        qsl[s + 1] = t
        lidx[s] = t - 1
    ns = len(out.scheduled)
    qsl[ns + 1 :] = t
    buf[o + 3 * S + 1 + S * W :] = _work_lists([sr.num_new_tokens for sr in out.scheduled], T, S)
    return PackedBatch(shape=shape, host=buf, num_seqs=ns, num_tokens=t)


def _work_lists(q_lens: list[int], T: int, S: int) -> np.ndarray:
    """The attention work lists' section of the packed array (layout read back by `_unpack`)."""
    tokens, nt, start, length, seq, ni = build_work(q_lens, T, S)
    return np.concatenate([tokens, [nt], start, length, seq, [ni]])


def _unpack(packed: jax.Array, shape: BatchShape):
    T, S, W, N = shape.num_tokens, shape.num_seqs, shape.max_pages, shape.num_items
    o = 3 * T
    w = o + 3 * S + 1 + S * W  # work lists
    i = w + T + 1  # items
    md = AttentionMetadata(
        slot_mapping=packed[2 * T : o],
        query_start_loc=packed[o : o + S + 1],
        seq_lens=packed[o + S + 1 : o + 2 * S + 1],
        block_tables=packed[o + 3 * S + 1 : w].reshape(S, W),
        work=AttentionWork(
            tokens=packed[w : w + T], num_tokens=packed[w + T], item_start=packed[i : i + N],
            item_len=packed[i + N : i + 2 * N], item_seq=packed[i + 2 * N : i + 3 * N], num_items=packed[i + 3 * N],
        ),
    )  # fmt: skip
    return packed[:T], packed[T : 2 * T], md, packed[o + 2 * S + 1 : o + 3 * S + 1]


def _step(params, kv, packed, *, cfg: ModelConfig, shape: BatchShape, backend: str, mesh=None):
    tokens, positions, md, logits_idx = _unpack(packed, shape)
    logits, kv = forward(params, cfg, tokens, positions, kv, md, logits_idx, backend=backend, mesh=mesh)
    return logits, kv  # [S, vocab] float32


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "backend", "mesh"))
def _all_logits(params, token_ids, *, cfg: ModelConfig, page_size: int, backend: str, mesh=None):
    """Logits at every position of one prompt, on a scratch paged cache. token_ids: [T], T a multiple of page."""
    T = token_ids.shape[0]
    pages = T // page_size
    kv_sharding = None if mesh is None else parallel.kv_sharding(mesh)
    kv = init_kv_cache(cfg, pages, page_size, params["embed"].dtype, sharding=kv_sharding)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(T, dtype=jnp.int32),
        query_start_loc=jnp.array([0, T], jnp.int32),
        seq_lens=jnp.array([T], jnp.int32),
        block_tables=jnp.arange(pages, dtype=jnp.int32)[None],
        work=AttentionWork(*(jnp.asarray(a) for a in build_work([T], T, 1))),
    )
    logits, _ = forward(params, cfg, token_ids, jnp.arange(T, dtype=jnp.int32), kv, md, backend=backend, mesh=mesh)
    return logits  # [T, vocab] float32


def num_pages_for(cfg: ModelConfig, cache: CacheConfig, kv_dtype, page_size: int, max_useful: int, tp: int = 1) -> int:
    """Pages that fit the cache budget: an explicit count, a byte budget, or a fraction of accelerator memory;
    a budget is capped at `max_useful` pages (every running sequence at full context, plus prefix-cache room).
    Under a tp-way split the budget is per device and a page costs each device only its KV heads."""
    if cache.num_pages:
        return cache.num_pages
    per_page = parallel.kv_bytes_per_page_per_device(cfg, page_size, kv_dtype, tp)
    budget = cache.kv_cache_bytes
    if budget is None:
        dev = jax.devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            free = stats["bytes_limit"] * cache.gpu_memory_utilization - stats.get("bytes_in_use", 0)
            budget = int(free * 0.85)  # leave room for activations and the compiled steps
        else:
            budget = 1 << 30
    return max(2, min(budget // per_page, max_useful))


class ModelRunner:
    """Owns the parameters and the paged KV cache on the device; executes one scheduled step at a time.

    tensor_parallel_size > 1: parameters and KV heads are split over a ("tp",) mesh of the first N devices (see
    `netra_jax.parallel`); the step's logits come back gathered on device 0, where the sampler runs."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        kv_dtype=jnp.float32,
        backend: str = "reference",
        tensor_parallel_size: int = 1,
    ):
        self.mesh = parallel.make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
        if self.mesh is not None:  # a no-op for parameters the loader already placed on this mesh
            params = parallel.shard_params(params, cfg, self.mesh)
            cfg = parallel.shard_config(cfg, tensor_parallel_size)  # KV heads replicated when fewer than N
        self.cfg, self.params = cfg, params
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages = math.ceil(max_model_len / page_size)
        self.buckets = token_buckets(max_num_batched_tokens)
        self.max_seqs_bucket = 1 << (max_num_seqs - 1).bit_length()
        self.backend = backend
        kv_sharding = None if self.mesh is None else parallel.kv_sharding(self.mesh)
        self.kv = init_kv_cache(cfg, num_pages, page_size, kv_dtype, sharding=kv_sharding)
        self.pad_slot = num_pages * page_size  # out of range: dropped by the KV write
        # sharded: KV out sharding = in sharding (donation reuses each device's pages), logits all-gathered
        out = {} if self.mesh is None else {"out_shardings": (parallel.replicated(self.mesh), kv_sharding)}
        self._jit = jax.jit(functools.partial(_step, mesh=self.mesh), static_argnames=("cfg", "shape", "backend"),
                            donate_argnums=(1,), **out)  # fmt: skip
        self.num_steps = 0

    # ------------------------------------------------------------------ shapes
    def shape_for(self, num_tokens: int) -> BatchShape:
        T = next((b for b in self.buckets if b >= num_tokens), None)
        if T is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")
        return BatchShape(T, min(T, self.max_seqs_bucket), self.max_pages)

    def all_shapes(self) -> list[BatchShape]:
        return sorted({self.shape_for(b) for b in self.buckets}, key=lambda s: s.num_tokens)

    # ------------------------------------------------------------------ execution
    def run(self, out: SchedulerOutput) -> tuple[jax.Array, PackedBatch]:
        """Dispatch the forward for a scheduled step; returns device logits [S_bucket, vocab] (async) and the pack."""
        shape = self.shape_for(out.num_batched_tokens)
        pb = pack_batch(out, shape, self.page_size, self.pad_slot)
        logits, self.kv = self._jit(
            self.params, self.kv, jnp.asarray(pb.host), cfg=self.cfg, shape=shape, backend=self.backend
        )
        if self.mesh is not None:  # the sampler and its inputs live on device 0
            logits = jax.device_put(logits, self.mesh.devices.flat[0])
        self.num_steps += 1
        return logits, pb

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        """Per-position logits of one prompt: float32 [len(ids), vocab]. Uses a scratch cache (the serving pages are
        untouched); one compiled variant per power-of-two length, compiled on first use."""
        T = max(self.page_size, 1 << (len(ids) - 1).bit_length())
        padded = np.zeros(T, np.int32)
        padded[: len(ids)] = ids
        out = _all_logits(self.params, jnp.asarray(padded), cfg=self.cfg, page_size=self.page_size,
                          backend=self.backend, mesh=self.mesh)  # fmt: skip
        return np.asarray(out[: len(ids)])

    def warmup_shape(self, shape: BatchShape) -> None:
        """Compile (and run once on an all-padding batch, which writes nothing) one step variant."""
        buf = np.zeros(shape.packed_len(), np.int32)
        buf[2 * shape.num_tokens : 3 * shape.num_tokens] = self.pad_slot
        buf[-(shape.num_tokens + 3 * shape.num_items + 2) :] = _work_lists([], shape.num_tokens, shape.num_seqs)
        logits, self.kv = self._jit(
            self.params, self.kv, jnp.asarray(buf), cfg=self.cfg, shape=shape, backend=self.backend
        )
        logits.block_until_ready()
