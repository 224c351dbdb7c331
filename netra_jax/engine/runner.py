"""Model runner: packs a SchedulerOutput into one flat ragged token batch padded to a token bucket, ships its
metadata as a single host array and runs the jitted forward over the donated paged KV cache, returning the logits of
the rows to sample (the engine samples them with `ops.sampling`)."""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from netra_jax import paged, parallel
from netra_jax.config import ModelConfig
from netra_jax.engine.buckets import ACCELERATOR_SMALLEST_BUCKET, token_buckets
from netra_jax.engine.scheduler import SchedulerOutput
from netra_jax.engine.step_layout import (
    PROMPT_LOGPROB_ROWS,
    BatchShape,
    PackedBatch,
    empty_batch,
    pack_batch,
    prompt_logprob_positions,
    unpack,
)
from netra_jax.engine_config import CacheConfig, LoRAConfig
from netra_jax.models.hooks import Hooks, HookSpec, StepHooks
from netra_jax.models.lora import LoRAAdapter, empty_slots, slot_blocks, slot_specs, write_slot
from netra_jax.models.transformer import forward, init_kv_cache
from netra_jax.ops.sampling_batch import MAX_LOGPROBS

log = logging.getLogger(__name__)


def _step(
    params,
    kv,
    packed,
    prev_ids=None,
    hook_arrays=None,
    hook_request=None,
    lora=None,
    lora_slots=None,
    hook_group=None,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    backend: str,
    mesh=None,
    hooks: StepHooks | None = None,
    matmul_backend: str = "xla",
):
    """One forward over the packed batch. prev_ids [max_seqs_bucket]: the previous step's sampled ids, gathered
    into placeholder slots (None: every token is known). hooks: the hook sets of the step's hooked requests with
    their arrays (one per set), each token's request index [T] and hook set [T] (-1: none; see
    `netra_jax.models.hooks`). lora, lora_slots: the LoRA adapter slots and each token's slot
    [T] (-1: the base model; see `netra_jax.models.lora`). Returns (logits [R, vocab] float32 of the sampled rows, kv,
    prompt logprobs of the P prompt rows or None, recorded activations {name: [T, ...]} or None)."""
    x = unpack(packed, shape)
    tokens = x.tokens  # [T]
    if prev_ids is not None:
        tokens = jnp.where(x.prev_rows >= 0, prev_ids[jnp.maximum(x.prev_rows, 0)], tokens)
    rows = x.logits_idx if not shape.prompt_rows else jnp.concatenate([x.logits_idx, x.prompt_idx])  # [S (+ P)]
    out = forward(
        params,
        cfg,
        tokens,
        x.positions,
        kv,
        x.md,
        rows,
        backend=backend,
        mesh=mesh,
        hooks=hooks,
        hook_arrays=hook_arrays,
        hook_request=hook_request,
        hook_group=hook_group,
        matmul_backend=matmul_backend,
        lora=lora,
        lora_slots=lora_slots,
    )
    logits, kv, records = out if hooks is not None else (*out, None)
    if not shape.prompt_rows:
        return logits, kv, None, records
    r = shape.num_rows
    return logits[:r], kv, _prompt_logprobs(logits[r:], x.prompt_target), records


def _prompt_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    """vLLM's prompt logprobs of P rows: the target's logprob [P] and rank [P] (1 = most likely), and the top
    MAX_LOGPROBS ids and logprobs [P, K]. logits: [P, vocab] float32, targets: [P] int32."""
    m = jnp.max(logits, -1, keepdims=True)  # [P, 1]
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m), -1, keepdims=True))  # [P, 1]
    target = jnp.take_along_axis(logits, targets[:, None], 1)  # [P, 1]
    rank = jnp.sum(logits > target, -1).astype(jnp.int32) + 1  # [P]
    top_vals, top_ids = lax.top_k(logits, min(MAX_LOGPROBS, logits.shape[1]))  # [P, K]
    return (target - lse)[:, 0], rank, top_ids.astype(jnp.int32), top_vals - lse


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "num_pages", "page_size", "kv_dtype", "backend", "mesh", "hooks", "matmul_backend"),
)
def _all_logits(
    params,
    token_ids,
    batch: paged.PagedBatch,
    hook_arrays=None,
    *,
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    kv_dtype,
    backend: str,
    mesh=None,
    hooks: HookSpec | None = None,
    matmul_backend: str = "xla",
):
    """Logits at every position of one prompt, on a scratch paged cache of `num_pages` pages in `kv_dtype` (the
    serving cache's: a quantized cache's logits are the ones its requests see). token_ids: [T];
    batch: its positions and metadata (`paged.build_batch`). Returns (logits [T, vocab] float32, the hooks'
    recorded activations {name: [T, ...]} or None)."""
    kv_sharding = None if mesh is None else parallel.kv_sharding(mesh)
    kv = paged.init_kv_cache(cfg, num_pages, page_size, kv_dtype, sharding=kv_sharding)
    out = forward(
        params,
        cfg,
        token_ids,
        batch.positions,
        kv,
        batch.metadata,
        backend=backend,
        mesh=mesh,
        hooks=hooks,
        hook_arrays=hook_arrays,
        matmul_backend=matmul_backend,
    )
    return out[0], (out[2] if hooks is not None else None)


def step_key(shape: BatchShape, lora: bool) -> tuple:
    """The step program of a shape (`lora`: the one for steps with an adapter's token) in `ModelRunner.programs`."""
    return ("step", shape, lora)


LORA_SLOT_KEY = ("lora_slot",)  # the program writing one adapter into its device slot, in `ModelRunner.programs`


def widen_key(num_rows: int) -> tuple:
    """The widening of `num_rows` sampled ids in `ModelRunner.programs`."""
    return ("widen", num_rows)


_write_slot = jax.jit(write_slot)  # one program for every adapter and slot (the slot a traced int32 scalar)


def _widen_ids(ids: jax.Array, *, size: int) -> jax.Array:
    """[S] int32 -> [size] int32, zero-padded."""
    return jnp.zeros(size, jnp.int32).at[: ids.shape[0]].set(ids)


# Of the accelerator memory the engine may use that is left once the weights are in, the KV pages take this share;
# the rest holds the steps' activations and temporaries, which the GPU compile check (benchmarks/gpu_compile) holds
# every step program's temporary bytes to.
KV_SHARE = 0.85
FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jax's GPU allocator's share of memory
_claimed_fraction: float | None = None


def claim_gpu_memory(utilization: float) -> bool:
    """Let jax's GPU allocator take `utilization` of each device's memory, vLLM's meaning of gpu_memory_utilization
    (jax's own default is 0.75 of it, and the engine took `utilization` of that: a 61 GB Qwen3-30B-A3B in bf16 did
    not fit an 80 GB A100, the GPU compile check found). Sets XLA_CLIENT_MEM_FRACTION, which jax reads when its GPU
    backend starts: only before that, and only when neither variable is set already. Returns whether it did."""
    global _claimed_fraction
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # cannot tell: leave the allocator as it is
        started = True
    if started or any(os.environ.get(v) for v in FRACTION_ENV):
        return False
    os.environ[FRACTION_ENV[0]] = repr(float(utilization))
    _claimed_fraction = float(utilization)
    return True


def usable_bytes(bytes_limit: int, utilization: float) -> float:
    """What the engine may use of an accelerator whose allocator may hold `bytes_limit` bytes: all of it when
    `claim_gpu_memory(utilization)` sized the allocator, else `utilization` of it."""
    return float(bytes_limit) if _claimed_fraction == float(utilization) else bytes_limit * utilization


def kv_budget(usable: float, bytes_in_use: int) -> int:
    """Bytes for the KV pages out of `usable` bytes of which `bytes_in_use` are taken (the weights); the rest of
    what is left, (1 - KV_SHARE) of it, is the margin for activations."""
    return int((usable - bytes_in_use) * KV_SHARE)


def max_useful_pages(max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """The most KV pages the engine can use: every running sequence at full context, twice (prefix-cache room)."""
    return 2 * max_num_seqs * -(-max_model_len // page_size)


def num_pages_for(
    cfg: ModelConfig,
    cache: CacheConfig,
    kv_dtype,
    page_size: int,
    max_useful: int,
    tp: int = 1,
    memory: tuple[float, int] | None = None,
) -> int:
    """Pages that fit the cache budget: an explicit count, a byte budget, or a fraction of accelerator memory
    (`kv_budget`); a budget is capped at `max_useful` pages (`max_useful_pages`). Under a tp-way split the budget is
    per device and a page costs each device only its KV heads. memory: (usable bytes, bytes in use) of the device
    the cache goes on; None: read from the first device (a CPU has no budget of its own: 1 GiB)."""
    if cache.num_pages:
        return cache.num_pages
    per_page = parallel.kv_bytes_per_page_per_device(cfg, page_size, kv_dtype, tp)
    budget = cache.kv_cache_bytes
    if budget is None:
        if memory is None:
            dev = jax.devices()[0]
            stats = dev.memory_stats() if dev.platform != "cpu" else None
            if stats and stats.get("bytes_limit"):
                usable = usable_bytes(stats["bytes_limit"], cache.gpu_memory_utilization)
                memory = (usable, stats.get("bytes_in_use", 0))
        budget = kv_budget(*memory) if memory is not None else 1 << 30
    return max(2, min(budget // per_page, max_useful))


@dataclass
class _HookSet:
    """A hook set some running requests use: the set, its static spec, its arrays on the device, the order it
    was registered in (a step lists its sets in that order) and how many requests run it."""

    hooks: Hooks
    spec: HookSpec
    arrays: dict
    serial: int
    users: int = 0


@dataclass
class StepResult:
    """A dispatched step: device arrays (not waited for) and the host-side pack they came from."""

    logits: jax.Array  # [R, vocab] float32, the sampled rows
    prompt_logprobs: tuple[jax.Array, ...] | None  # see _prompt_logprobs; None unless the shape has prompt rows
    batch: PackedBatch
    records: dict[str, jax.Array] | None = None  # activations the hooks recorded, [T, ...] per hook name


class ModelRunner:
    """Owns the parameters and the paged KV cache on the device; executes one scheduled step at a time.

    tensor_parallel_size > 1: parameters and KV heads are split over a ("tp",) mesh of the first N devices (see
    `netra_jax.parallel`); the step's logits come back gathered on device 0, where the sampler runs.
    overlap: steps take the previous step's sampled ids on device (see `run`); every step is compiled that way.
    num_spec_tokens k > 0 (speculative decoding): every variant returns min(T, S + min(S, max_spec_seqs) * k) logit
    rows, enough for up to max_spec_seqs sequences to verify k proposed tokens each, so no proposal length or
    acceptance pattern needs its own compile.
    Steps with prompt logprobs pad to `prompt_logprob_buckets` (see `set_prompt_logprob_buckets`).
    compile_for: a compile-only device (a GPU target's, `jax.experimental.topologies`): nothing is allocated, the
    parameters may be ShapeDtypeStructs, and the KV cache and id buffers are ShapeDtypeStructs placed on it. Such a
    runner lowers its steps (`all_shapes`, `lower_step`, whose `.compile()` is a deviceless compile for that target)
    and runs nothing; `backend` must then name the backend the target runs ("auto" decides on the host's devices)."""

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
        overlap: bool = False,
        num_spec_tokens: int = 0,
        max_spec_seqs: int | None = None,
        matmul_backend: str = "xla",
        compile_for: jax.Device | None = None,
        lora: LoRAConfig | None = None,
    ):
        if compile_for is not None and tensor_parallel_size > 1:
            raise ValueError("a runner compiled for a target device (compile_for) runs on that one device only")
        self.compile_for = compile_for
        if overlap and num_spec_tokens:
            raise ValueError(
                "overlapped steps cannot verify proposals (the next step needs this one's accepted length)"
            )
        self.mesh = parallel.make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
        orig_cfg = cfg
        if self.mesh is not None:  # a no-op for parameters the loader already placed on this mesh
            params = parallel.shard_params(params, cfg, self.mesh)
            cfg = parallel.shard_config(cfg, tensor_parallel_size)  # KV heads replicated when fewer than N
        else:  # committed, as the parameter cache restores them: converted or restored, the steps lower alike and
            params = self._place(params)  # hit the same persistent compilation-cache entries
        self.cfg, self.params = cfg, params
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages = math.ceil(max_model_len / page_size)
        platform = jax.default_backend() if compile_for is None else compile_for.platform
        smallest = 1 if platform == "cpu" else ACCELERATOR_SMALLEST_BUCKET  # (why: engine/buckets.py)
        self.buckets = token_buckets(max_num_batched_tokens, smallest)
        # the most tokens one step can hold: the token budget, every sequence's whole context, every KV slot
        self.max_step_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len, num_pages * page_size)
        self.set_prompt_logprob_buckets(fine=True)  # compiled on first use; a full warm-up asks for fewer
        self.max_seqs_bucket = 1 << (max_num_seqs - 1).bit_length()
        self.backend = backend
        self.matmul_backend = matmul_backend  # quant.MATMULS: "cpu_rows" for decode-sized matmuls on CPU
        self.overlap = overlap
        self.num_spec_tokens = num_spec_tokens
        self.max_spec_seqs = max_num_seqs if max_spec_seqs is None else max_spec_seqs
        kv_sharding = None if self.mesh is None else parallel.kv_sharding(self.mesh)
        if compile_for is None:
            self.kv = init_kv_cache(cfg, num_pages, page_size, kv_dtype, sharding=kv_sharding)
        else:
            self.kv = self._place(jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size, kv_dtype)))
        self.pad_slot = paged.padding_slot(num_pages, page_size)  # out of range: dropped by the KV write
        # sharded: KV out sharding = in sharding (donation reuses each device's pages), logits all-gathered
        out = {}
        if self.mesh is not None:
            rep = parallel.replicated(self.mesh)
            kv_out = jax.tree.map(lambda a: a.sharding, self.kv)  # a quantized cache's scales have their own
            out = {"out_shardings": (rep, kv_out, rep, rep)}
        self._jit = jax.jit(
            functools.partial(_step, mesh=self.mesh, matmul_backend=matmul_backend),
            static_argnames=("cfg", "shape", "backend", "hooks"),
            donate_argnums=(1,),
            **out,
        )
        self._widen = jax.jit(functools.partial(_widen_ids, size=self.max_seqs_bucket))
        self._no_ids = self._place_ids(jnp.zeros(self.max_seqs_bucket, jnp.int32))
        self.num_steps = 0
        # programs compiled ahead of time (a bundle, `netra_jax.engine.bundle`) by `step_key` / `widen_key` and the
        # sampler's program keys: run instead of the jitted functions, which compile on a miss
        self.programs: dict[tuple, Callable] = {}
        # while a warm-up compiles in the background (`engine.warmup.BackgroundCompile`): the step keys whose programs
        # (and those they need) are compiled; steps pad up to the smallest of them that holds them (`shape_for`).
        # None: no restriction (everything compiled, or programs compile on first use)
        self.usable: frozenset[tuple] | None = None
        # per-request interventions (see `add_hooked`): the live hook sets and each hooked request's (set, index)
        self._hook_sets: dict[int, _HookSet] = {}
        self._hooked: dict[str, tuple[_HookSet, int]] = {}
        self._hook_serial = 0
        # LoRA adapter slots (models/lora.py), written by `set_lora_slot`; every step with an adapter's token takes
        # them (one program for every mix of adapters; steps of base requests alone run the program without them)
        # (under tensor parallelism split as the weights they modify: `models.lora.slot_specs`)
        self.lora = None
        self.lora_config = lora
        self._kv_replicas = 1 if self.mesh is None else parallel.kv_replicas(orig_cfg, tensor_parallel_size)
        if lora is not None:  # in the weights' dtype; abstract for a compile-only runner (nothing allocated)
            dtype = params["embed"].dtype
            make = functools.partial(empty_slots, cfg, lora.max_loras, lora.max_lora_rank, dtype)
            self.lora = self._place_lora(make() if compile_for is None else jax.eval_shape(make))

    # ------------------------------------------------------------------ LoRA
    def set_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter` in device slot `slot` (None: clear it). Steps already dispatched keep the slots they took."""
        if self.lora is None:
            raise ValueError("this runner was built without LoRA slots (enable_lora)")
        if adapter is not None:  # KV heads repeated as the base model's are under tensor parallelism
            adapter = parallel.expand_adapter_kv(adapter, self.cfg.head_dim, self._kv_replicas)
        blocks = slot_blocks(self.cfg, adapter, self.lora, parallel.tp_size(self.mesh))  # numpy, checked
        write = self.programs.get(LORA_SLOT_KEY, _write_slot)  # compiled at warm-up, else on first use
        self.lora = self._place_lora(write(self.lora, np.int32(slot), self._place(blocks)))

    def lower_lora_slot(self) -> jax.stages.Lowered:
        """Trace and lower the slot write `set_lora_slot` runs (one program for every adapter and slot)."""
        blocks = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), slot_blocks(self.cfg, None, self.lora))
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        return _write_slot.trace(self.lora, slot, self._place(blocks)).lower()

    def _place_lora(self, slots):
        """LoRA slots placed: split over the mesh as the weights they modify (`slot_specs`), else as `_place`."""
        if self.mesh is None:
            return self._place(slots)
        specs = slot_specs(slots)
        return jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec)), slots, specs)

    def _lora_tokens(self, out: SchedulerOutput, pb: PackedBatch, slot_of: dict[str, int] | None) -> np.ndarray:
        """[T] int32 each token's adapter slot (-1: the base model and padding)."""
        slots = np.full(pb.shape.num_tokens, -1, np.int32)
        if slot_of:
            qsl = pb.shape.layout.view(pb.host, "query_start_loc")
            for s, sr in enumerate(out.scheduled):
                slots[qsl[s] : qsl[s + 1]] = slot_of.get(sr.request_id, -1)
        return slots

    # ------------------------------------------------------------------ interventions
    def add_hooked(self, request_id: str, hooks: Hooks, index: int = 0) -> None:
        """Run `hooks` on request `request_id`'s tokens in every step that schedules it, until `drop_hooked`;
        `index` is what its tokens show as `HookContext.request`. Requests of other hook sets, or none, share the
        steps: each row runs its own set's functions (see `netra_jax.models.hooks`). A step compiles once per
        combination of hook specs it holds, on first use. ValueError for hooks the model cannot run."""
        hs = self._hook_sets.get(id(hooks))
        if hs is None:
            hooks.check(self.cfg)
            self._hook_serial += 1
            hs = _HookSet(hooks, hooks.spec, self._place(hooks.arrays), self._hook_serial)
            self._hook_sets[id(hooks)] = hs
        hs.users += 1
        self._hooked[request_id] = (hs, index)

    def drop_hooked(self, request_id: str) -> None:
        """Stop running hooks on the request (finished or aborted); a set without requests is forgotten."""
        entry = self._hooked.pop(request_id, None)
        if entry is not None:
            hs = entry[0]
            hs.users -= 1
            if not hs.users:
                self._hook_sets.pop(id(hs.hooks), None)

    def hook_records(self, request_id: str) -> tuple[str, ...]:
        """The hook names recorded for the request (empty when it has no hooks)."""
        entry = self._hooked.get(request_id)
        return () if entry is None else entry[0].spec.records

    def _step_hooks(self, out: SchedulerOutput, pb: PackedBatch) -> dict:
        """The step's hook arguments: the specs of the hook sets its requests run (in registration order), their
        arrays, each token's request index and hook set [T] (-1: none), and the keys a hooked pattern spans (the
        longest hooked sequence, rounded up to a power of two); {} when no scheduled request has hooks."""
        if not self._hooked:  # the common step: no request has hooks
            return {}
        entries = [self._hooked.get(sr.request_id) for sr in out.scheduled]
        sets = sorted({id(e[0]): e[0] for e in entries if e is not None}.values(), key=lambda h: h.serial)
        if not sets:
            return {}
        group_of = {id(h): g for g, h in enumerate(sets)}
        lay = pb.shape.layout
        qsl, positions = lay.view(pb.host, "query_start_loc"), lay.view(pb.host, "positions")
        group = np.full(pb.shape.num_tokens, -1, np.int32)
        request = np.full(pb.shape.num_tokens, -1, np.int32)
        longest = 0
        for s, e in enumerate(entries):
            lo, hi = int(qsl[s]), int(qsl[s + 1])
            if e is not None and hi > lo:
                group[lo:hi], request[lo:hi] = group_of[id(e[0])], e[1]
                longest = max(longest, int(positions[hi - 1]) + 1)
        spec = StepHooks(tuple(h.spec for h in sets))
        if spec.wants_pattern:
            keys = max(self.page_size, 1 << (longest - 1).bit_length())
            spec = StepHooks(spec.sets, min(keys, self.max_pages * self.page_size))
        arrays = tuple(h.arrays for h in sets)
        return {"hooks": spec, "hook_arrays": arrays, "hook_request": request, "hook_group": group}

    def _place(self, tree):
        """Arrays placed as the parameters are (replicated over the mesh under tensor parallelism; for a compile-only
        device, ShapeDtypeStructs on it)."""
        if self.compile_for is not None:
            on = jax.sharding.SingleDeviceSharding(self.compile_for)
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), tree)
        if self.mesh is not None:
            return jax.device_put(tree, parallel.replicated(self.mesh))
        return jax.device_put(tree, jax.devices()[0])

    # ------------------------------------------------------------------ shapes
    def set_prompt_logprob_buckets(self, fine: bool) -> None:
        """Steps computing prompt logprobs (prefill chunks of the requests asking for them, scored continuations) pad
        to a subset of the buckets, so they add a few variants instead of doubling them all. fine: the powers of 4
        from 64 below the largest bucket, and the largest, so a step of over 64 tokens pads to less than 4x its size
        (64 scored SmolLM2 pairs: 1.7 s instead of 3.1 s), for programs compiled on first use, where a variant costs
        nothing until a step needs it. Not fine: two (PROMPT_LOGPROB_ROWS's and the largest), for a warm-up that
        compiles every variant ahead of time (each adds seconds to a server's time to ready)."""
        top = next(b for b in self.buckets if b >= self.max_step_tokens)  # the largest bucket a step can need
        if fine:
            powers_of_4 = {1 << k for k in range(6, top.bit_length(), 2)}
            self.prompt_logprob_buckets = tuple(b for b in self.buckets if b in powers_of_4 and b < top) + (top,)
        else:
            smallest = next(b for b in self.buckets if b >= min(PROMPT_LOGPROB_ROWS, top))
            self.prompt_logprob_buckets = tuple(sorted({smallest, top}))

    def shape_for(self, num_tokens: int, prompt_logprobs: bool = False, lora: bool = False) -> BatchShape:
        """The bucket of a step of `num_tokens` tokens; `prompt_logprobs`: the variant that also computes the
        logprobs of up to PROMPT_LOGPROB_ROWS prompt positions (one of `prompt_logprob_buckets`). While only some
        programs are usable (`usable`, a warm-up compiling in the background), the smallest usable bucket holding
        the step (`lora`: usable for steps with an adapter's token)."""
        buckets = self.prompt_logprob_buckets if prompt_logprobs else self.buckets
        fits = [b for b in buckets if b >= num_tokens]
        if not fits:
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")
        usable = self.usable
        if usable is not None:
            for T in fits:
                shape = self._shape(T, prompt_logprobs)
                if step_key(shape, lora) in usable:
                    return shape
            log.warning("no compiled program holds a step of %d tokens yet: compiling one now", num_tokens)
        return self._shape(fits[0], prompt_logprobs)

    def _shape(self, T: int, prompt_logprobs: bool) -> BatchShape:
        rows = min(T, PROMPT_LOGPROB_ROWS) if prompt_logprobs else 0
        S = min(T, self.max_seqs_bucket)
        R = min(T, S + min(S, self.max_spec_seqs) * self.num_spec_tokens) if self.num_spec_tokens else 0
        return BatchShape(T, S, self.max_pages, rows, R)

    def all_shapes(self) -> list[BatchShape]:
        """Every step variant the engine can reach: the shape `shape_for` gives each step size from 1 to
        `max_step_tokens` tokens, plain and with prompt logprobs. Buckets only a larger step would need are left out."""
        top = self.max_step_tokens
        shapes = set()
        for plp in (False, True):
            buckets = self.prompt_logprob_buckets if plp else self.buckets
            shapes |= {self.shape_for(n, plp) for n in (*(b for b in buckets if b < top), top)}
        return sorted(shapes, key=lambda s: (s.num_tokens, s.prompt_rows))

    # ------------------------------------------------------------------ execution
    def run(
        self,
        out: SchedulerOutput,
        prev_ids: jax.Array | None = None,
        prev_rows: dict[str, int] | None = None,
        lora_slot_of: dict[str, int] | None = None,
    ) -> StepResult:
        """Dispatch the forward for a scheduled step (asynchronously: nothing here waits for the device).
        Overlap: `prev_ids` [max_seqs_bucket] are the previous step's sampled ids still on device (`widen`) and
        `prev_rows` maps a request id to its row there; a chunk ending on a placeholder takes that token.
        `lora_slot_of`: the adapter slot of each request running with a LoRA adapter (the others: the base model)."""
        wants_plp = any(prompt_logprob_positions(s) for s in out.scheduled)
        adapted = bool(lora_slot_of) and any(s.request_id in lora_slot_of for s in out.scheduled)
        shape = self.shape_for(out.num_batched_tokens, wants_plp, adapted)
        pb = pack_batch(out, shape, self.page_size, self.pad_slot, prev_rows)
        hooked = self._step_hooks(out, pb)
        lora_tokens = None if self.lora is None else self._lora_tokens(out, pb, lora_slot_of)
        logits, plp, records = self._dispatch(pb.host, shape, prev_ids, hooked, lora_tokens)
        self.num_steps += 1
        return StepResult(logits, plp, pb, records)

    def _dispatch(
        self,
        host: np.ndarray,
        shape: BatchShape,
        prev_ids: jax.Array | None,
        hooked: dict | None = None,
        lora_tokens: np.ndarray | None = None,
        force_lora: bool = False,
    ):
        if self.compile_for is not None:
            raise RuntimeError("a runner built with compile_for lowers steps for its target device and runs none")
        if self.overlap:
            prev_ids = self._no_ids if prev_ids is None else prev_ids
        elif prev_ids is not None:
            raise ValueError("prev_ids given to a runner built without overlap")
        hooked = dict(hooked or {}) | self._lora_args(shape, lora_tokens, force=force_lora)
        exe = None if "hooks" in hooked else self.programs.get(step_key(shape, "lora" in hooked))
        if exe is not None:  # compiled ahead of time, for the same arguments
            logits, self.kv, plp, records = exe(self.params, self.kv, host, prev_ids, **hooked)
        else:
            logits, self.kv, plp, records = self._jit(
                self.params, self.kv, host, prev_ids, cfg=self.cfg, shape=shape, backend=self.backend, **hooked
            )  # host: numpy, moved by the call (one host->device copy)
        if self.mesh is not None:  # the sampler and its inputs live on device 0
            logits = jax.device_put(logits, self.mesh.devices.flat[0])
        return logits, plp, records

    def _lora_args(self, shape: BatchShape, lora_tokens: np.ndarray | None = None, force: bool = False) -> dict:
        """The step's LoRA arguments: the slots and each token's slot. None when no token of the step has an
        adapter (unless `force`): such a step runs the program without LoRA, as an engine without adapters would
        (on CPU its decode layers stay one kernel call each); so does every step without LoRA enabled."""
        if self.lora is None:
            return {}
        if lora_tokens is None or (lora_tokens < 0).all():
            if not force:
                return {}
            lora_tokens = np.full(shape.num_tokens, -1, np.int32)  # every token the base model's
        return {"lora": self.lora, "lora_slots": lora_tokens}

    def widen(self, token_ids: jax.Array) -> jax.Array:
        """A step's sampled ids [S] as the fixed-size [max_seqs_bucket] device array the next step gathers from."""
        exe = self.programs.get(widen_key(token_ids.shape[0]))
        ids = self._widen(token_ids) if exe is None else exe(token_ids)  # on the sampler's device
        return ids if self.mesh is None else self._place_ids(ids)

    def _place_ids(self, ids: jax.Array) -> jax.Array:
        if self.mesh is not None:
            return jax.device_put(ids, parallel.replicated(self.mesh))
        return self._place(ids)

    def prompt_logits(self, ids: list[int], hooks: Hooks | None = None):
        """Per-position logits of one prompt: float32 [len(ids), vocab]. Uses a scratch cache (the serving pages are
        untouched); one compiled variant per power-of-two length (and hook spec), compiled on first use (the
        `LLM.logits` hook; requests' prompt logprobs come from the ordinary step). With `hooks`, returns (logits,
        the recorded activations {name: [len(ids), ...] numpy}); `HookContext.request` is 0."""
        n = len(ids)
        T = max(self.page_size, 1 << (n - 1).bit_length())
        pages = -(-T // self.page_size)
        batch = paged.build_batch([n], [n], [range(pages)], page_size=self.page_size, num_pages=pages, num_tokens=T)
        hooked = {}
        if hooks is not None:
            hooks.check(self.cfg)
            hooked = {"hook_arrays": self._place(hooks.arrays), "hooks": hooks.spec}
        logits, records = _all_logits(
            self.params,
            paged.flat_tokens([ids], T),
            batch,
            cfg=self.cfg,
            num_pages=pages,
            page_size=self.page_size,
            kv_dtype=np.dtype(self.kv.k[0].dtype),
            backend=self.backend,
            mesh=self.mesh,
            matmul_backend=self.matmul_backend,
            **hooked,
        )
        logits = np.asarray(logits[: len(ids)])
        if hooks is None:
            return logits
        records = {name: np.asarray(a[:n]) for name, a in records.items()}
        return logits, {name: a[..., :n] if name.endswith(".pattern") else a for name, a in records.items()}

    def lower_step(self, shape: BatchShape, lora: bool = False) -> jax.stages.Lowered:
        """Trace and lower one step variant with the arguments `run` passes it (compiling the result is what the
        first `run` of that shape would compile; it then finds it in the jit's caches). lora: the program of a step
        in which some token has an adapter (a runner built with LoRA slots; one program for every mix)."""
        prev_ids = self._no_ids if self.overlap else None
        host = empty_batch(shape, self.pad_slot)  # numpy, as pack_batch's
        extra = self._lora_args(shape, force=True) if lora else {}
        if extra and self.compile_for is not None:  # each token's slot [T], abstract on the target
            extra["lora_slots"] = self._place(jax.ShapeDtypeStruct((shape.num_tokens,), jnp.int32))
        return self._jit.trace(
            self.params,
            self.kv,
            host,
            prev_ids,
            cfg=self.cfg,
            shape=shape,
            backend=self.backend,
            **extra,
        ).lower()

    def lower_widen(self, num_rows: int) -> jax.stages.Lowered:
        """Trace and lower `widen` of `num_rows` sampled ids (overlapped steps)."""
        if self.compile_for is not None:
            ids = self._place(jax.ShapeDtypeStruct((num_rows,), jnp.int32))
        else:
            ids = jax.device_put(np.zeros(num_rows, np.int32), jax.devices()[0])  # as the sampler returns them
        return self._widen.trace(ids).lower()

    def warmup_shape(self, shape: BatchShape) -> None:
        """Compile (and run once on an all-padding batch, which writes nothing) one step variant (with LoRA enabled,
        both its programs: with adapters and without), and the widening of its sampled ids when steps overlap."""
        logits, plp, _ = self._dispatch(empty_batch(shape, self.pad_slot), shape, None)
        if self.lora is not None:
            jax.block_until_ready((logits, plp))
            logits, plp, _ = self._dispatch(empty_batch(shape, self.pad_slot), shape, None, force_lora=True)
        if self.overlap:
            ids = jax.device_put(np.zeros(shape.num_rows, np.int32), jax.devices()[0])  # as the sampler returns
            jax.block_until_ready(self.widen(ids))
        jax.block_until_ready((logits, plp))
