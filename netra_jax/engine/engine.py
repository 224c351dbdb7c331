"""The engine's core loop: schedule a step, run it on the device, sample, then hand the tokens to the output
processor. With async scheduling the host schedules and dispatches step N+1 before it reads step N's tokens."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from netra_jax.config import ModelConfig
from netra_jax.engine import bundle
from netra_jax.engine.activations import ActivationRecorder
from netra_jax.engine.block_pool import BlockPool
from netra_jax.engine.embedder import Embedder
from netra_jax.engine.input_processor import InputProcessor, PromptType
from netra_jax.engine.lora_slots import LoRASlots
from netra_jax.engine.observer import EngineObserver
from netra_jax.engine.output_processor import OutputProcessor
from netra_jax.engine.outputs import RequestOutput
from netra_jax.engine.program_store import ProgramStore
from netra_jax.engine.request_queue import check_priority
from netra_jax.engine.request_state import RequestState, SampleState
from netra_jax.engine.runner import ModelRunner, StepResult, max_useful_pages, num_pages_for
from netra_jax.engine.sampler import sampling_rows
from netra_jax.engine.scheduler import Scheduler, SchedulerOutput
from netra_jax.engine.spec import accept, make_proposer
from netra_jax.engine.spec.policy import Speculation
from netra_jax.engine.step_trace import StepTrace, trace_path_from_env
from netra_jax.engine.warmup import StepLimits, WarmupReport, engine_variants, warm_up
from netra_jax.engine.weights import Sleep, placed_like
from netra_jax.engine_config import EngineConfig
from netra_jax.lora_request import LoRARequest
from netra_jax.models.frozen_params import FrozenParams, freeze
from netra_jax.models.hooks import Hooks
from netra_jax.ops import sampling
from netra_jax.ops.kv_quant import storage_dtype
from netra_jax.pooling import NOT_AN_EMBEDDING_ENGINE, PoolingSpec, pooling_spec
from netra_jax.sampling_params import SamplingParams
from netra_jax.tokenization.tokenizer import Tokenizer

__all__ = ["LLMEngine", "PromptType", "runner_options"]

log = logging.getLogger(__name__)


@dataclass
class _Step:
    """A dispatched step whose tokens the host has not read yet."""

    sched: SchedulerOutput
    run: StepResult
    rows: list[sampling.RowSampling | None] | None = None
    batch: sampling.SamplingBatch | None = None
    sampled: sampling.SamplerOutput | None = None
    next_ids: jax.Array | None = None  # overlap: the sampled ids, widened for the next step's gather
    row_of: dict[str, int] | None = None  # request id -> its sampled row (requests that sample)


def runner_options(config: EngineConfig, model_cfg: ModelConfig, kv_dtype, platform: str | None = None) -> dict:
    """`ModelRunner`'s keyword arguments for this engine configuration, all but `num_pages` (which the engine sizes
    from the device's memory, `num_pages_for`): what the engine's steps are compiled with. platform: where the steps
    run (jax.default_backend() when None)."""
    spec = config.speculative if config.task == "generate" else None
    sched = config.scheduler
    return dict(
        page_size=config.cache.page_size,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=config.max_model_len or model_cfg.max_context,
        kv_dtype=kv_dtype,
        backend=config.resolved_backend(platform),
        matmul_backend=config.resolved_matmul_backend(platform),
        tensor_parallel_size=config.tensor_parallel_size,
        overlap=config.async_scheduling and spec is None,
        num_spec_tokens=spec.num_speculative_tokens if spec else 0,
        max_spec_seqs=spec.disable_by_batch_size if spec else None,
        lora=config.lora,
    )


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread (see AsyncEngine).

    Overlapped (`config.async_scheduling`): step() schedules and dispatches step N+1, then reads step N's tokens
    (ready by then), appends them, detokenizes, checks stops and streams, and only then builds N+1's sampling rows
    (penalties and grammar masks see N's token) and dispatches its sampler. N+1's forward takes its placeholder
    tokens from N's sampled ids on device. A request that N finished has its N+1 token discarded.

    Task "embed" (`config.task`): no generation (add_request refuses); `embed` pools prompts' final hidden states
    as `pooling` says (default: vLLM's, last token normalized) through `embedder`, and the runner keeps 2 pages.

    Speculative decoding (`config.speculative`): before each step a proposer suggests up to k next tokens for each
    decoding request (`Request.spec_token_ids`); the step computes them like a short prefill chunk, samples every
    one of their positions exactly as lone decode steps would (same seed stream, penalties and bias per position),
    and keeps the proposals up to the first that differs from the target's token (see `spec.accept`). Steps do not
    overlap then (the next step needs this one's accepted length). `draft_params`: the draft model's
    (ModelConfig, params) for method "draft_model"."""

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        params,
        tokenizer: Tokenizer,
        pooling: PoolingSpec | None = None,
        draft_params: tuple[ModelConfig, object] | None = None,
    ):
        self.config = config
        self.model_config = model_cfg
        self.tokenizer = tokenizer
        self.vocab_size = model_cfg.vocab_size
        config.check_model(model_cfg)
        spec = config.speculative if config.task == "generate" else None
        cache, sched = config.cache, config.scheduler
        kv_dtype = storage_dtype(config.kv_cache_dtype, params["embed"].dtype)
        opts = runner_options(config, model_cfg, kv_dtype)
        self.max_model_len, self.overlap = opts["max_model_len"], opts["overlap"]
        useful = max_useful_pages(sched.max_num_seqs, self.max_model_len, cache.page_size)
        num_pages = opts["num_pages"] = num_pages_for(
            model_cfg, cache, kv_dtype, cache.page_size, useful, config.tensor_parallel_size
        )
        if config.task == "embed":  # embedding steps bring their own scratch pages; the runner's stay unused
            num_pages = opts["num_pages"] = 2
        self.pool = BlockPool(num_pages, cache.page_size, enable_prefix_caching=cache.enable_prefix_caching)
        if config.lora is not None:  # the scheduler admits at most as many distinct adapters as there are slots
            sched = dataclasses.replace(sched, max_loras=config.lora.max_loras)
        self.scheduler = Scheduler(sched.for_platform(jax.default_backend()), self.pool, self.max_model_len)
        self.runner = ModelRunner(model_cfg, params, **opts)
        self.loras = None if config.lora is None else LoRASlots(config.lora, model_cfg, self.runner)
        self.speculation: Speculation | None = None  # proposals before each step (engine/spec/policy.py)
        if spec is not None:
            proposer = make_proposer(
                spec,
                self.runner,
                self.scheduler,
                draft_params,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            )
            self.speculation = Speculation(spec, proposer, self.runner.max_spec_seqs)
        self.pooling = self.embedder = None
        if config.task == "embed":
            self.pooling = pooling or pooling_spec(None, model_cfg.hidden_size, config.pooler_config)
            self.embedder = Embedder(self.runner, self.pooling.pooling_type, sched.max_num_batched_tokens)
        self.inputs = InputProcessor(
            tokenizer,
            self.vocab_size,
            self.max_model_len,
            model_cfg.eos_token_ids,
            sched.max_waiting,
            config.seed,
            config.max_logprobs,
        )
        self.outputs = OutputProcessor(tokenizer, self.scheduler)
        self.activations = ActivationRecorder()  # what hooked requests' hooks record (see add_request's hooks)
        self._live_params = self.runner.params  # the weights the prefix cache was computed with
        self._sleep = Sleep()  # what `sleep` keeps of the KV caches and weights
        self._frozen: tuple | None = None  # (params, their read-only view), see frozen_params
        self._states: dict[str, RequestState] = {}
        self._sample_of: dict[str, tuple[RequestState, SampleState]] = {}  # scheduler request id -> its sample
        self._in_flight: _Step | None = None
        self.device_wait_s = 0.0  # time the host spent blocked on step results (the rest of a step is host work)
        self.num_requests = 0
        self.ready = False
        self.warmup_report: WarmupReport | None = None
        self.compiled_report: bundle.LoadReport | None = None  # what `load_compiled` loaded
        self._observers: list[EngineObserver] = []  # told of the loop's events (engine/observer.py)
        self.step_trace: StepTrace | None = None  # the per-step trace, if one was asked for (`trace_steps`)
        if (path := trace_path_from_env()) is not None:  # opt-in ($NETRA_STEP_TRACE)
            self.trace_steps(path)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_total * self.pool.block_size

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage type, e.g. "float32", "int8", "float8_e4m3fn"."""
        kv = self.runner.kv if self._sleep.kv is None else self._sleep.kv[0]  # (asleep: its layout)
        return str(kv.k[0].dtype)

    def warmup(
        self, progress: Callable[[str], None] | None = None, workers: int | None = None, background: bool = False
    ) -> float:
        """Compile every program a request can need (the reachable step buckets, sampler variants, the LoRA slot
        write, the proposer; task "embed": the embedding buckets) in `workers` threads, reporting each to `progress`
        (see `engine.warmup.warm_up`); returns seconds spent. `warmup_report` then says what was compiled.
        background: return once the programs the first requests need are compiled (`warmup.ready_shapes`), the
        rest compiling in a background thread (`programs_pending`); until they are, steps pad up into the compiled
        buckets and the scheduler chunks prompts to the largest of them. A server's warm-up (background) also keeps
        its programs in a `ProgramStore` beside the persistent compilation cache and loads them from there
        on its next start."""
        self._check_awake()
        self.runner.set_prompt_logprob_buckets(fine=False)  # few variants, as every one is compiled now
        self.warmup_report = warm_up(
            self.runner,
            self.vocab_size,
            embedder=self.embedder,
            proposer=None if self.speculation is None else self.speculation.proposer,
            progress=progress,
            workers=workers,
            background=background,
            on_change=self._limit_steps,
            busy=lambda: self.scheduler.num_running + self.scheduler.num_waiting > 0,
            store=self._program_store() if background else None,
        )
        self.ready = True
        return self.warmup_report.seconds

    def _program_store(self) -> ProgramStore | None:
        """Where a server keeps its compiled programs between starts (`ProgramStore`): beside jax's
        persistent compilation cache when that is on (`<cache>/xla` -> `<cache>/xla-programs`)."""
        xla = jax.config.jax_compilation_cache_dir
        if self.config.compilation_cache_dir == "" or not xla:
            return None
        return ProgramStore(Path(f"{xla.rstrip('/')}-programs"), bundle.engine_signature(self))

    def _limit_steps(self, limits: StepLimits | None) -> None:
        """Keep the scheduler to what a background warm-up has compiled so far (None: everything is)."""
        if limits is None:
            self.scheduler.limit_step_tokens(None)
            self.scheduler.hold_waiting(None)
            return
        self.scheduler.limit_step_tokens(limits.max_tokens)
        held = limits.held

        def hold(req) -> bool:
            return (req.sampling_params.prompt_logprobs is not None, bool(req.lora_id)) in held

        self.scheduler.hold_waiting(hold if held else None)

    def stop_background_compile(self, timeout: float | None = 60.0) -> None:
        """Let a background warm-up finish the programs it is compiling and start no other (a server stopping)."""
        if self.warmup_report is not None and self.warmup_report.background is not None:
            self.warmup_report.background.stop(timeout)

    @property
    def programs_pending(self) -> int:
        """Programs a background warm-up has still to compile (0 when none is running)."""
        return 0 if self.warmup_report is None else self.warmup_report.pending

    def load_compiled(self, bundle_dir: str | os.PathLike) -> bundle.LoadReport:
        """Load the programs of a bundle `netra-jax compile` wrote (`engine.bundle`) when it was compiled for this
        engine's configuration on this kind of device; `warmup` then compiles only the programs it did not hold. The
        report says how many were loaded, or in one line why none was (the engine then compiles as usual)."""
        self._check_awake()
        self.runner.set_prompt_logprob_buckets(fine=False)  # the warm-up's set, which a bundle holds
        variants = engine_variants(self.runner, self.vocab_size)
        self.compiled_report = bundle.load(bundle_dir, self.runner, bundle.engine_signature(self), variants)
        return self.compiled_report

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_key: str | None = None,
        prompt_logprobs_from: int = 1,
        lora_request: LoRARequest | None = None,
        hooks: Hooks | None = None,
        hook_index: int = 0,
    ) -> None:
        """Validate and queue a request (n samples become n scheduler requests sharing the prompt's blocks).
        `cache_key`: mixed into its prefix-cache hashes, so it shares cached blocks only with requests of the same
        key (None: the plain cache; a unique key: no sharing at all).
        `priority`: smaller is served first; anything but 0 needs `--scheduling-policy priority` (ValueError).
        `prompt_logprobs_from` (with `params.prompt_logprobs`): the first prompt token whose logprob is computed;
        the tokens before it are context only, so prefix-cache hits may cover them (scoring continuations).
        `lora_request`: the LoRA adapter it runs with (the engine needs `config.lora`); read and checked on first use,
        a bad one raises LoRAError (a ValueError naming the problem). Its prefix-cache blocks are its adapter's own.
        `hooks`: interventions run on this request's tokens in every step (`netra_jax.models.hooks`; every sample of
        n), beside requests with other hooks or none; its tokens show `hook_index` as `HookContext.request`. Its KV
        depends on the hooks, so it shares no prefix-cache block (unless `cache_key` says otherwise); what the hooks
        record comes back on the finished output (`RequestOutput.activations`, each `CompletionOutput.activations`).
        Not with speculative decoding (ValueError).
        Raises ValueError for bad input before anything reaches the device; the engine state is unchanged."""
        if self.embedder is not None:
            raise ValueError("this engine serves embeddings (task 'embed'); text generation needs task 'generate'")
        self._check_awake()
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduler.scheduling_policy)
        if hooks is not None:
            self._check_hooks(hooks)
            cache_key = cache_key or f"hooked:{id(self)}:{request_id}"
        if lora_request is not None:
            self.add_lora(lora_request)
        state = self.inputs.process(request_id, prompt, params, arrival_time, priority, prompt_logprobs_from)
        if lora_request is not None:  # the adapter's KV is its own: blocks hashed under its id
            cache_key = f"lora:{lora_request.lora_int_id}" + ("" if cache_key is None else f"|{cache_key}")
        for sample in state.samples:
            if cache_key is not None:
                sample.request.cache_key = cache_key
            if lora_request is not None:
                sample.request.lora_id = lora_request.lora_int_id
        added = []
        try:
            for sample in state.samples:
                self.scheduler.add_request(sample.request)
                added.append(sample.request)
        except Exception:
            for req in added:
                self.scheduler.abort_request(req.request_id)
            raise
        self._states[request_id] = state
        for sample in state.samples:
            self._sample_of[sample.request.request_id] = (state, sample)
            if hooks is not None:
                self.runner.add_hooked(sample.request.request_id, hooks, hook_index)
        self.num_requests += 1

    def _check_hooks(self, hooks: Hooks) -> None:
        if not isinstance(hooks, Hooks):
            raise ValueError(f"hooks must be a netra_jax.Hooks, got {type(hooks).__name__}")
        if self.speculation is not None:
            raise ValueError(
                "hooks are not supported together with speculative decoding (draft proposals would run unhooked "
                "and rejected tokens be recorded): build the engine without speculative_config to run hooks"
            )
        hooks.check(self.model_config)

    # ------------------------------------------------------------------ LoRA adapters (vLLM's add/remove/list)
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (LoRAError naming the problem), so that requests naming it start at once."""
        if self.loras is None:
            raise ValueError("a LoRA adapter was given, but LoRA is not enabled (enable_lora=True)")
        self.loras.register(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False when unknown. ValueError while an unfinished request runs or waits with it."""
        if self.loras is None or lora_int_id not in self.loras.known:
            return False
        users = sum(1 for _, s in self._sample_of.values() if s.request.lora_id == lora_int_id)
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} has {users} unfinished requests; retry once they finish")
        self.loras.unregister(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set() if self.loras is None else set(self.loras.known)

    def lora_requests(self) -> tuple[set[str], set[str]]:
        """Names of the adapters of (running, waiting) requests (the lora_requests_info gauge's labels)."""
        if self.loras is None:
            return set(), set()
        known = self.loras.known
        for _ in range(3):  # read from another thread (/metrics) while the engine thread may change them
            try:
                running = {r.lora_id for r in self.scheduler.running if r.lora_id}
                unfinished = {s.request.lora_id for _, s in tuple(self._sample_of.values()) if s.request.lora_id}
                break
            except RuntimeError:
                continue
        else:
            return set(), set()
        name = lambda ids: {known[i].lora_name for i in ids if i in known}  # noqa: E731
        return name(running), name(unfinished - running)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples) and free its KV blocks now (a step still in flight for it only
        writes them before any later step can reuse them). Returns False if it is unknown."""
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        for sample in state.samples:
            self.scheduler.abort_request(sample.request.request_id)
            self._sample_of.pop(sample.request.request_id, None)
            self.activations.discard(sample.request.request_id)
            self.runner.drop_hooked(sample.request.request_id)
        return True

    @property
    def params(self):
        """The parameter pytree the steps run (swap it through `update_params`); while the weights sleep, their host
        copy."""
        return self.runner.params if self._sleep.weights is None else self._sleep.weights[0][0]

    def frozen_params(self) -> FrozenParams:
        """`params` as a read-only view (`models.frozen_params.FrozenParams`, what `LLM.params` gives), the same
        object while the weights do not change."""
        live = self.params
        if self._frozen is None or self._frozen[0] is not live:
            self._frozen = (live, freeze(live))
        return self._frozen[1]

    def prompt_forward(self, prompt: PromptType, hooks=None) -> tuple[list[int], np.ndarray, dict | None]:
        """One forward over a whole prompt (text, token ids or a prompt dict) on a scratch cache, the serving pages
        untouched: (its token ids, logits [T, vocab] float32, the hooks' recorded activations {name: [T, ...]} or
        None without hooks). ValueError for a bad prompt or one longer than the model's context."""
        self._check_awake()
        ids = self.inputs.prompt_ids(prompt)[1]
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the model's context of {self.max_model_len}")
        if hooks is None:
            return ids, self.runner.prompt_logits(ids), None
        logits, activations = self.runner.prompt_logits(ids, hooks)
        return ids, logits, activations

    def _attach_activations(self, state: RequestState, out: RequestOutput) -> None:
        """A finished request's recorded activations onto its output: each sample's on its CompletionOutput
        ({name: [positions, ...]}, prompt and output but the last token, which never ran through the model), the
        first sample's also as `RequestOutput.activations`."""
        samples = [s for s in state.samples if self.runner.hook_records(s.request.request_id)]
        if not samples:
            return
        completions = {c.index: c for c in out.outputs}
        P = len(out.prompt_token_ids)
        lengths = [P + len(completions[s.index].token_ids) - 1 for s in samples]
        found = self.activations.pop_samples([s.request.request_id for s in samples], P, lengths)
        for sample, acts in zip(samples, found, strict=True):
            completions[sample.index].activations = acts
        out.activations = completions[min(completions)].activations

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """Pooled final hidden states of whole prompts (checked token ids, each within max_model_len), not yet
        truncated or normalized (`pooling.finish_embeddings`): [len(prompts), hidden] float32. Task "embed" only."""
        if self.embedder is None:
            raise ValueError(NOT_AN_EMBEDDING_ENGINE)
        self._check_awake()
        return self.embedder.embed(prompts)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or an overlapped step is still in flight (dispatched before the requests in
        it finished): one more `step` reads that step back, so no device work outlives the loop that started it."""
        return bool(self._states) or self._in_flight is not None

    def settle(self) -> None:
        """Read back an overlapped step left in flight when its last request finished, if no request runs: the
        synchronous callers (LLM.generate) end with no device work outstanding."""
        if self._in_flight is not None and not self._states:
            self.step()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix (blocks in use keep their contents but stop serving hits). False, and
        nothing changes, while requests run."""
        if self.has_unfinished_requests():
            return False
        self.pool.reset_prefix_cache()
        return True

    def update_params(self, params) -> None:
        """Swap the model's weights for `params` (same pytree structure and shapes as `runner.params`, its dicts and
        lists as any mappings and sequences, e.g. `LLM.params`' frozen view or a tree mapped over it; or `load_model`'s
        layout with q, k and v apart for an engine holding them joined), placed as the current ones; the prefix cache,
        computed with the old weights, is dropped. No copy where a leaf already has the current one's dtype and
        sharding (the engine then runs the caller's arrays); a float leaf of another float dtype is cast, one on
        another device moved, and an engine holding q, k and v joined joins the caller's (the one concatenation).
        Compiled steps are reused (the weights are arguments). Also while the engine sleeps: the new weights go to
        the device and count as awake. RuntimeError while requests run; ValueError for a mismatched pytree."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot update the weights while requests are running; finish or abort them first")
        old = self.runner.params if self._sleep.weights is None else self._sleep.weights[0][1]  # (its layout)
        self.runner.params = self._live_params = placed_like(old, params, self.runner.matmul_backend)
        self._frozen = None  # (its view would keep the old weights alive)
        if self._sleep.weights is not None:  # the new weights are on the device: awake (a draft model's too)
            self._sleep.wake_weights(self._runners(), first=1)
        self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep (vLLM's sleep mode)
    def sleep(self, level: int = 1) -> None:
        """Release the device memory of the KV cache (level 1), and also move the weights to host memory (level 2),
        e.g. while a trainer shares the accelerator; the prefix cache is dropped. Requests are refused
        (RuntimeError) until `wake_up`. The KV cache's arrays are deleted; the weights' device arrays are released
        (freed once nothing else, e.g. a trainer that gave them through update_params, holds them). Sleeping deeper
        than now adds level 2's part. RuntimeError while requests run; ValueError for another level."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep while requests are running; finish or abort them first")
        self.pool.reset_prefix_cache()
        self._sleep.sleep(self._runners(), level)
        if level == 2:
            self._live_params = self._frozen = None

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep`: "weights" back on the device as they were placed, "kv_cache" allocated again, zeroed (None:
        both; vLLM's tags, so that weights can be woken and updated before the KV cache is allocated). Waking
        something awake does nothing. ValueError for an unknown tag."""
        tags = ("weights", "kv_cache") if tags is None else tuple(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; known: 'weights', 'kv_cache'")
        if "weights" in tags and self._sleep.weights is not None:
            self._sleep.wake_weights(self._runners())
            self._live_params, self._frozen = self.runner.params, None
        if "kv_cache" in tags and self._sleep.kv is not None:
            self._sleep.wake_kv(self._runners())
        self.pool.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether the KV cache or the weights sleep (vLLM's `is_sleeping`)."""
        return self._sleep.asleep

    def _check_awake(self) -> None:
        if self.is_sleeping():
            raise RuntimeError("the engine is asleep (sleep()): call wake_up() before sending requests")

    def _runners(self) -> list[ModelRunner]:
        """The model runners whose KV cache and weights sleep: the engine's, and a draft model's."""
        draft = getattr(self.speculation.proposer, "draft", None) if self.speculation is not None else None
        return [self.runner] + ([draft] if isinstance(draft, ModelRunner) else [])

    def _params_replaced(self) -> None:
        """The runner's weights were assigned directly, not through update_params: no cached prefix may be reused
        (its KV came from the old weights)."""
        log.warning("the model's weights were replaced without update_params; dropping the prefix cache")
        self.pool.reset_prefix_cache()
        self._live_params = self.runner.params

    def spec_stats(self) -> dict | None:
        """Speculative decoding counters (see `spec.SpecStats.as_dict`); None when speculation is off."""
        return None if self.speculation is None else self.speculation.stats.as_dict()

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: EngineObserver) -> None:
        """Tell `observer` of every step's events from now on (see `netra_jax.engine.observer`)."""
        self._observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        self._observers.remove(observer)

    def trace_steps(self, path) -> StepTrace:
        """Record every step from now on as a JSON line in `path` (`netra_jax.engine.step_trace`); returns the
        trace (`close` it to flush and stop writing; it stays an observer)."""
        sched = self.scheduler.config  # (resolved for the platform)
        facts = {
            "buckets": list(self.runner.buckets),
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "scheduler": dataclasses.asdict(sched),
            "async_scheduling": self.overlap,
        }
        self.step_trace = StepTrace(path, facts)
        self.add_observer(self.step_trace)
        return self.step_trace

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that changed (new tokens or finished).
        Overlapped, these are the tokens of the step dispatched by the previous call. If it raises, the steps whose
        results were not applied are unscheduled (`Scheduler.cancel`), so their requests run again on the next call
        instead of waiting forever for tokens that will never come. Observers see the call's events
        (`add_observer`)."""
        if not self._observers:
            return self._step()
        wait0 = self.device_wait_s
        for o in self._observers:
            o.step_started()
        try:
            return self._step()
        finally:
            has_unfinished = self.scheduler.has_unfinished()
            for o in self._observers:
                o.step_done(self.device_wait_s - wait0, has_unfinished)

    def _step(self) -> list[RequestOutput]:
        if self.runner.params is not self._live_params:
            self._params_replaced()
        prev, self._in_flight = self._in_flight, None
        scheduled = [] if prev is None else [prev.sched]
        try:
            if self.speculation is not None:
                self.speculation.propose(self.scheduler.running, self._grammar_of, self.max_model_len)
            sched = self.scheduler.schedule()
            scheduled.append(sched)
            if not self.overlap:
                if sched.is_empty:
                    return []
                cur = self._dispatch(sched, None)
                self._sample(cur)
                return self._process(cur)
            cur = None if sched.is_empty else self._dispatch(sched, prev)
            outputs = self._process(prev) if prev is not None else []
            if cur is not None:
                self._sample(cur)
                self._in_flight = cur
            return outputs
        except BaseException:
            for out in scheduled:
                self.scheduler.cancel(out)
            raise

    def _grammar_of(self, req):
        """A running request's grammar (None: unconstrained); False when the engine no longer serves it."""
        entry = self._state_of(req)
        return False if entry is None else entry[1].grammar

    def _dispatch(self, sched: SchedulerOutput, prev: _Step | None) -> _Step:
        """Pack and dispatch the forward; placeholder tokens come from `prev`'s sampled ids on device."""
        lora = {}  # with adapters: each request's device slot, its adapter loaded there first if need be
        if self.loras is not None:
            lora_of = {s.request_id: s.request.lora_id for s in sched.scheduled}
            slots = self.loras.slots_for(set(lora_of.values()))
            lora["lora_slot_of"] = {rid: slots[lid] for rid, lid in lora_of.items() if lid}
        if prev is None:
            run = self.runner.run(sched, **lora)
        else:
            run = self.runner.run(sched, prev.next_ids, prev.row_of, **lora)
        for o in self._observers:
            o.dispatched(sched, run, self.scheduler.num_running, self.scheduler.num_waiting)
        if self.speculation is not None:
            self.speculation.proposer.observe(run)
        return _Step(sched, run)

    def _sample(self, step: _Step) -> None:
        """Build the sampling rows (from the requests' current tokens and grammars, `engine.sampler`) and dispatch
        the sampler; start copying its results to the host."""
        rows = sampling_rows(step.sched.scheduled, self._state_of)
        batch = sampling.build_sampling_batch(rows, step.run.batch.shape.num_rows, self.vocab_size)
        out = sampling.sample(  # numpy leaves: moved by the call
            step.run.logits, batch.arrays, key=batch.key, programs=self.runner.programs
        )
        for a in (*out, *(step.run.prompt_logprobs or ())):
            if a is not None:
                a.copy_to_host_async()
        step.rows, step.batch, step.sampled = rows, batch, out
        if self.overlap:
            step.next_ids = self.runner.widen(out.token_ids)
            row_start = step.run.batch.row_start
            step.row_of = {s.request_id: row_start[i] for i, s in enumerate(step.sched.scheduled) if s.sample}

    def _process(self, step: _Step) -> list[RequestOutput]:
        """Read a step's tokens (waiting for the device if needed), advance the scheduler, then let the output
        processor detokenize, check stops and build the outputs of the requests that changed."""
        so, sched = step.sampled, step.sched
        t0 = time.perf_counter()
        ids = np.asarray(so.token_ids)
        wait = time.perf_counter() - t0
        self.device_wait_s += wait
        for o in self._observers:
            o.tokens_read(sched, t0, wait)
        lps = (
            None
            if so.logprobs is None
            else tuple(np.asarray(a) for a in (so.logprobs, so.top_ids, so.top_logprobs, so.processed_logprobs))
        )
        row_start = step.run.batch.row_start
        sampled = {}
        for i, s in enumerate(sched.scheduled):
            r = row_start[i]
            if step.rows[r] is None:
                continue
            drafts = s.spec_token_ids
            if drafts:
                sampled[s.request_id] = accept(drafts, ids[r : r + len(drafts) + 1])
                self.speculation.record(s.request, len(drafts), len(sampled[s.request_id]) - 1)
            else:
                sampled[s.request_id] = [int(ids[r])]
        self._record_prompt_logprobs(step)
        if step.run.records:
            self.activations.collect(sched, step.run.batch, step.run.records, self.runner.hook_records)
        self.scheduler.update_from_output(sched, sampled)
        changed: dict[str, RequestState] = {}
        for i, s in enumerate(sched.scheduled):  # first every sample's tokens, then one output per request
            entry = self._state_of(s.request)
            r = row_start[i]
            if step.rows[r] is None or entry is None:
                continue
            state, sample = entry
            req = s.request
            new = req.num_output_tokens - sample.tokens_emitted  # 0: skipped (finished or aborted meanwhile)
            for j, token in enumerate(req.output_token_ids[req.num_output_tokens - new :]):
                k = int(step.batch.num_logprobs[r + j])
                row_lps = None if lps is None or k < 0 else (*(a[r + j] for a in lps), k)
                if self.outputs.append_token(sample, token, row_lps, last=j == new - 1) and j < new - 1:
                    req.truncate_output(req.num_output_tokens - new + j + 1)  # a stop string ended it here
                    sample.tokens_emitted = req.num_output_tokens
                    break
            if new:
                changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            out = self.outputs.output(state)
            if out.finished:
                self._attach_activations(state, out)
                self._forget(state)
            outputs.append(out)
        return outputs

    def _record_prompt_logprobs(self, step: _Step) -> None:
        rows = step.run.batch.prompt_rows
        if not rows:
            return
        lp, rank, top_ids, top_lps = (np.asarray(a) for a in step.run.prompt_logprobs)
        for j, (i, position) in enumerate(rows):
            entry = self._state_of(step.sched.scheduled[i].request)
            if entry is not None:
                self.outputs.record_prompt_logprob(entry[0], position, lp[j], rank[j], top_ids[j], top_lps[j])

    def _state_of(self, req) -> tuple[RequestState, SampleState] | None:
        """The state of a scheduled request; None once its outputs are final or it was aborted (its id may be in
        use again by then)."""
        entry = self._sample_of.get(req.request_id)
        return entry if entry is not None and entry[1].request is req else None

    def _forget(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        for sample in state.samples:
            self._sample_of.pop(sample.request.request_id, None)
            self.runner.drop_hooked(sample.request.request_id)
            self.activations.discard(sample.request.request_id)
