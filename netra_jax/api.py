"""The Python API: `LLM`, vLLM-compatible generate / chat / stream, lm-eval style `score_continuations`, embeddings,
plus the research hooks (per-position `logits`, `run_with_hooks`, `update_params`). Its options are `EngineArgs`';
the engine itself comes from `netra_jax.engine.factory.build_engine`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from netra_jax.engine.engine import PromptType
from netra_jax.engine.factory import build_engine, resolve_model_path
from netra_jax.engine.outputs import RequestOutput
from netra_jax.engine_args import EngineArgs
from netra_jax.engine_config import PoolerConfig, SpeculativeConfig
from netra_jax.interventions import HookedOutput, ParamsUpdate
from netra_jax.lora_request import LoRARequest
from netra_jax.models.frozen_params import FrozenParams
from netra_jax.models.hooks import Hooks, hook_points
from netra_jax.patching import CachedRun
from netra_jax.pooling import (
    NOT_AN_EMBEDDING_ENGINE,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    embedding_prompt_ids,
    finish_embeddings,
)
from netra_jax.sampling_params import SamplingParams
from netra_jax.scoring import ContinuationScore, continuation_score, pair_token_ids, scoring_params
from netra_jax.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _is_single(x) -> bool:
    """One prompt or continuation (text, or token ids) rather than a list of them."""
    return isinstance(x, str) or (isinstance(x, Sequence) and bool(x) and isinstance(x[0], int))


class LLM:
    """Offline inference, vLLM style: `LLM(model).generate(prompts, SamplingParams(...))`.

    Construction loads the model and returns; each compiled program (the step of a token bucket, a sampler
    variant) is compiled on the first call that needs it, so a small model answers its first prompt within seconds
    and the first call of each new bucket pays its compile. `warmup=True` compiles every program a request can reach
    before returning instead, as `netra-jax serve` does before it reports ready. Every option is checked before any
    weight is read (ValueError).

    Args:
        model: A Hugging Face directory or a .gguf file (None: the embedded default, SmolLM2-135M-Instruct).
        tokenizer: A tokenizer other than the model's own: a directory, a tokenizer.json or a .gguf file.
        trust_remote_code: Accepted for vLLM compatibility; remote code is never run. A checkpoint whose
            config.json has an `auto_map` is refused unless this is True and its architecture is one netra_jax
            implements natively (then the native implementation is used); one whose architecture is not native is
            always refused, with a message that says so.
        dtype: "auto" | "float32" | "bfloat16".
        max_model_len: The longest sequence (prompt + output); None: the model's context.
        max_num_seqs: Sequences running in one step.
        max_num_batched_tokens: Tokens in one step (longer prompts are prefilled in chunks).
        kv_cache_memory: The KV cache's size in bytes (per device under tensor parallelism); None: from
            gpu_memory_utilization on accelerators, 1 GiB on CPU.
        num_kv_pages: An explicit KV page count (overrides kv_cache_memory).
        page_size: Tokens per KV page.
        kv_cache_dtype: The KV cache's type, as vLLM's: "auto" (the weights' dtype) | "float32" | "bfloat16" |
            "int8" | "fp8" (= "fp8_e4m3") | "fp8_e5m2". int8 and fp8 store each token's key and value of each KV
            head with one float32 scale: about 4x the tokens of a float32 cache in the same memory, 2x bfloat16.
        gpu_memory_utilization: The fraction of accelerator memory for weights and KV cache, in (0, 1].
        enable_prefix_caching: Share the KV pages of common prompt prefixes between requests.
        attention_backend: "auto" | "reference" | "triton" | "mosaic" (GPU kernels) | "triton_interpret" |
            "mosaic_interpret".
        tensor_parallel_size: Devices the weights and KV heads are split over.
        matmul_backend: "auto" | "xla" | "cpu_rows" | "cpu_rows_q8" | "gpu" | "gpu_sm80" | "gpu_interpret": how
            matmuls run ("cpu_rows_q8": the CPU kernels with GGUF Q4_0 ... Q8_0, Q4_K, Q5_K and Q6_K weights
            times activations rounded to int8 blocks of 32 (a scale per 256 values against the K-quants),
            llama.cpp's arithmetic: faster, not float-exact; "cpu_rows": the same kernels on float32 activations,
            the arithmetic of the de-quantized weights);
            "auto" runs the CPU kernels when they build and the weights are not split ("cpu_rows_q8" for a GGUF
            file, "cpu_rows" for a Hugging Face checkpoint), the GPU
            kernels of quantized weights on CUDA (`netra_jax.quant.gpu`: the Pallas W4A16 / W8A16 kernel; fp8 as
            W8A8 on XLA's fp8 dot on sm89+ ("gpu"), W8A16 on older GPUs ("gpu_sm80")) when the weights are not
            split, XLA's dot otherwise.
        quantization: None, or a weight-only method applied at load to the projections, the lm_head and the MoE
            experts (per expert): "int8" or "fp8" (per-output-channel scales), "int4" (llama.cpp's Q4_0 blocks of
            32); under tensor parallelism each device quantizes its own shard. A GGUF file's quantized blocks are
            kept as they are anyway (sliced per device under tensor parallelism). A Hugging Face FP8 / AWQ / GPTQ /
            compressed-tensors checkpoint is served as stored: another method here is a ConfigError, its own ("fp8"
            of an FP8 checkpoint) changes nothing.
        seed: Seeds the requests that give no seed.
        warmup: Compile every reachable program before returning (minutes on CPU for a large token budget); False:
            compile each on first use.
        enforce_eager: vLLM's switch for skipping ahead-of-time compilation (CUDA graphs there): here, nothing is
            compiled before the first call, which is already the default; True together with warmup=True is a
            ValueError. Every step still runs as one compiled XLA program.
        compilation_cache_dir: The persistent XLA compilation cache; None: <cache dir>/xla, "": off.
        compiled: A directory of programs compiled ahead of time by `netra-jax compile` for this model and these
            options: loaded instead of compiled when they match (else a warning names what differs).
        task: "generate", or "embed": an embedding model, used through `embed`.
        pooler_config: Task "embed": a PoolerConfig, or a dict with pooling_type LAST | MEAN | CLS and normalize,
            over the checkpoint's own pooling.
        load_format: "auto", or "dummy": random weights from config.json (benchmarks).
        async_scheduling: Schedule step N+1 while step N runs on the device.
        scheduling_policy: "fcfs" | "priority" (serve by each request's priority, see `generate`).
        speculative_config: vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
            "prompt_lookup_min": m} or {"model": draft_path, "num_speculative_tokens": k}; greedy and seeded outputs
            are identical to decoding without it (see `netra_jax.engine.spec`).
        max_logprobs: The most `logprobs` / `prompt_logprobs` a request may ask for (vLLM's default 20, also the
            most the compiled sampler computes); a request asking for more is a ValueError.
        enable_lora: Serve LoRA adapters: `generate(..., lora_request=LoRARequest(name, id, path))`, any mix of
            adapters and the base model in one batch (see `netra_jax.models.lora`).
        max_loras: Adapters held on the device at once; a request of another adapter waits until one of them has
            no running request.
        max_lora_rank: The largest adapter rank served (every device slot is padded to it).
        max_cpu_loras: Adapters kept read in host memory (None: max_loras); others are read again when needed.
        batch_invariant: Run every step on the batch-invariant CPU kernels (vLLM's batch-invariant mode): a
            request's logits, sampled tokens and logprobs do not depend on what else is in the batch, on chunked
            prefill, prefix-cache hits or preemption, and each sampled token's `raw_logprobs` /
            `processed_logprobs` equal `netra_jax.rl.sequence_logprobs`' bit for bit (float32 activations, bfloat16
            weights and KV cache read as stored). Slower (see docs/research.md); CPU only, one device, no LoRA.
        **engine_options: Any other option of `netra_jax.engine_args.EngineArgs` (max_waiting,
            align_chunks_to_buckets, served_model_name); every option has the default EngineArgs gives it, except
            warmup (False here).

    Raises:
        FileNotFoundError: The model or tokenizer path does not exist.
        ValueError: An invalid option, or a model that cannot be served (ConfigError, CheckpointError).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        tokenizer: str | os.PathLike | None = None,
        trust_remote_code: bool = False,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | None = None,
        num_kv_pages: int | None = None,
        page_size: int = 16,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        matmul_backend: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        warmup: bool = False,
        enforce_eager: bool = False,
        compilation_cache_dir: str | None = None,
        compiled: str | os.PathLike | None = None,
        task: str = "generate",
        pooler_config: PoolerConfig | dict | None = None,
        load_format: str = "auto",
        async_scheduling: bool = True,
        scheduling_policy: str = "fcfs",
        speculative_config: SpeculativeConfig | dict | None = None,
        max_logprobs: int = 20,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        batch_invariant: bool = False,
        **engine_options: Any,
    ):
        if model is not None and not Path(model).exists():
            raise FileNotFoundError(f"model path {model} does not exist")
        if tokenizer is not None and not Path(tokenizer).exists():
            raise FileNotFoundError(f"tokenizer path {tokenizer} does not exist")
        args = EngineArgs(
            model=str(model) if model else None,
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            num_kv_pages=num_kv_pages,
            page_size=page_size,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size,
            matmul_backend=matmul_backend,
            quantization=quantization,
            seed=seed,
            warmup=warmup,
            enforce_eager=enforce_eager,
            compilation_cache_dir=compilation_cache_dir,
            compiled=str(compiled) if compiled is not None else None,
            task=task,
            pooler_config=pooler_config,
            load_format=load_format,
            async_scheduling=async_scheduling,
            scheduling_policy=scheduling_policy,
            speculative_config=speculative_config,
            max_logprobs=max_logprobs,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            batch_invariant=batch_invariant,
            **engine_options,
        )
        self.config = args.create_engine_config()
        self.engine = build_engine(self.config)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ accessors
    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self):
        """The model's shape and variant flags (`netra_jax.config.ModelConfig`), as the pure forward takes it."""
        return self.engine.model_config

    @property
    def params(self) -> FrozenParams:
        """A read-only view of the live parameter pytree the engine runs (layout: `netra_jax.models.transformer`):
        read it, pass it to the pure forward, `jax.grad` or optax (trees of the same kind come back); assigning into
        it raises TypeError. Change the weights through `update_params` (with a tree mapped over this one, or
        `params.unfreeze()` edited), which keeps what was derived from them consistent. The same object while the
        weights do not change. While the weights sleep (`sleep(level=2)`), their host copy."""
        return self.engine.frozen_params()

    def update_params(self, params) -> ParamsUpdate:
        """Swap the model's weights for `params`: a tree of the structure and shapes of `LLM.params` (e.g.
        `jax.tree.map` over it, a trainer's copy updated by optax, `params.unfreeze()` edited) or `load_model`'s
        layout, q, k and v apart, which a CPU engine joins as it holds them. Arrays that already have the live
        weights' dtype and placement are referenced, not copied (only the joined q/k/v weights of a CPU engine are
        concatenated); float arrays of another dtype are cast, others moved to the device. The prefix cache,
        computed with the old weights, is dropped, so no later request reuses stale KV; compiled programs are
        reused. Allowed while the engine sleeps (the new weights are then awake). Used as a context manager
        (`with llm.update_params(new): ...`), the previous weights come back on exit.

        Returns:
            A ParamsUpdate (its `restore()` puts the previous weights back).

        Raises:
            ValueError: The pytree's structure, a shape or a dtype differs.
            RuntimeError: Requests are running.
        """
        previous = self.engine.params
        self.engine.update_params(params)
        return ParamsUpdate(self.engine, previous)

    # ------------------------------------------------------------------ sleep mode (vLLM's)
    def sleep(self, level: int = 1) -> None:
        """Free the accelerator for something else, e.g. a trainer between rollouts (vLLM's LLM.sleep). Level 1
        deletes the KV cache's device arrays; level 2 also moves the weights to host memory (their device arrays are
        released: freed once nothing else holds them). The prefix cache is dropped. Until `wake_up`, requests (and
        `logits`, `run_with_hooks`, `embed`) raise RuntimeError; `update_params` is allowed.

        Raises:
            ValueError: A level other than 1 or 2.
            RuntimeError: Requests are running.
        """
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` (vLLM's LLM.wake_up): the weights back on the device, the KV cache allocated again and
        zeroed. tags: "weights" and / or "kv_cache" to wake one part (None: both), e.g. the weights first to update
        them, then the KV cache. Generation afterwards is what it was before sleeping."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the KV cache or the weights sleep."""
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's LLM.reset_prefix_cache), e.g. between benchmark runs or after
        the weights changed outside `update_params` (which drops it itself). Only while no request runs (nor a step
        is in flight): then every cached KV page goes back to the free list and True is returned; otherwise nothing
        changes and False is returned.

        Returns:
            Whether the prefix cache was reset.
        """
        return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ research hooks
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Per-position logits of a prompt: float32 [len(token_ids), vocab] (row i predicts token i + 1). One forward
        per call on a scratch cache, compiled once per power-of-two length; to score many continuations,
        `score_continuations` batches them through the engine's compiled steps instead."""
        if self.engine.embedder is not None:
            raise ValueError("logits need task 'generate' (a model loaded with task 'embed' has no lm_head)")
        return self.engine.prompt_forward({"prompt_token_ids": token_ids})[1]

    def run_with_hooks(self, prompt: PromptType, hooks: Hooks) -> HookedOutput:
        """One forward over a whole prompt with `hooks` (see `netra_jax.models.hooks`): per-position logits after
        the edits, and the recorded activations. On a scratch cache (the engine's pages and prefix cache are
        untouched); compiled once per hook spec and power-of-two length. `HookContext.request` is 0.

        Returns:
            A HookedOutput with the token ids, logits [T, vocab] and activations {name: [T, ...]}.
        """
        if self.engine.embedder is not None:
            raise ValueError("run_with_hooks needs task 'generate' (a model loaded with task 'embed' has no lm_head)")
        if not isinstance(hooks, Hooks):
            raise ValueError(f"hooks must be a netra_jax.Hooks, got {type(hooks).__name__}")
        return HookedOutput(*self.engine.prompt_forward(prompt, hooks))

    def hook_points(self) -> dict[str, tuple]:
        """Every hook point of the model: {name: shape}, "T" standing for the token rows and "K" for the keys an
        attention pattern spans (see `netra_jax.models.hooks`). The same names run in `forward`, `forward_dense`,
        `run_with_hooks`, `run_with_cache` and `generate`."""
        return hook_points(self.engine.model_config)

    def run_with_cache(
        self,
        prompts: PromptType | Sequence[PromptType],
        names: Iterable[str] | None = None,
        hooks: Hooks | Sequence[Hooks | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[CachedRun]:
        """Record activations of many prompts in one batched pass through the engine (TransformerLens's
        run_with_cache, ragged: each prompt at its own length).

        Each prompt is a request prefilled by the engine's compiled steps beside the others (as many per step as
        `max_num_batched_tokens` allows; prompts of every length share the programs), recording `names`, with the
        edits of `hooks` applied (one set for all prompts or one per prompt; `HookContext.request` is the prompt's
        index), e.g. `netra_jax.patch` writing activations cached from another run. Values are those of
        `run_with_hooks` on each prompt alone, to float32 rounding.

        Args:
            prompts: One prompt or a list: text, token ids, or a prompt dict.
            names: The hook names to record (default: every point `hook_points` lists; "logits" is [T, vocab] per
                prompt, patterns [T, heads, T]: name only what you need for long prompts).
            hooks: Edits (and head masks, data) to run; their own `record` names are recorded too.
            use_tqdm: Show a progress bar.

        Returns:
            One CachedRun per prompt, in order: its token ids and {name: [len(prompt), ...]} float arrays.
        """
        prompts, _ = self._normalize(prompts, None)
        cfg = self.engine.model_config
        names = list(hook_points(cfg)) if names is None else list(names)
        per_prompt = self._per_prompt(hooks, len(prompts), "hook sets")
        recording: dict[int, Hooks] = {}  # one recording set per distinct user set (one compiled spec each)
        for h in per_prompt:
            if id(h) not in recording:
                base = h or Hooks()
                record = [*names, *(n for n in base.record if n not in names)]
                recording[id(h)] = Hooks(edit=base.edit, record=record, head_mask=base.head_mask, data=base.data)
        one_token = SamplingParams(max_tokens=1, temperature=0.0)
        outs = self.generate(prompts, one_token, use_tqdm, hooks=[recording[id(h)] for h in per_prompt])
        return [CachedRun(out.prompt_token_ids, out.activations or {}) for out in outs]

    def score_continuations(
        self,
        prompts: Sequence[str | Sequence[int]],
        continuations: Sequence[str | Sequence[int]],
        *,
        add_special_tokens: bool = False,
        use_tqdm: bool = False,
    ) -> list[ContinuationScore]:
        """Log-likelihood of each continuation given its prompt (lm-evaluation-harness's `loglikelihood`), all pairs
        batched through the engine's ordinary steps: each pair is one request over prompt + continuation whose
        prefill computes the logprobs of the continuation tokens only, and ends after one greedy token. Pairs that
        share a prompt (several answers to one question) get its full KV blocks from the prefix cache.

        Tokenization: a text pair as lm-eval tokenizes it (`scoring.encode_pair`: the continuation in the prompt's
        context, the prompt's trailing whitespace moved to the continuation); token ids as given. A text
        continuation needs a text prompt.

        Args:
            prompts: One prompt (text or token ids) per pair.
            continuations: One continuation (text or token ids) per pair, scored after its prompt.
            add_special_tokens: Let the tokenizer add its special tokens (e.g. a BOS) to text prompts; lm-eval's
                default is not to.
            use_tqdm: Show a progress bar.

        Returns:
            One ContinuationScore per pair, in order: per-token logprobs and ranks of the continuation, their sum
            and whether every continuation token is the most likely one.

        Raises:
            ValueError: Mismatched lengths, an empty prompt or continuation, a pair longer than the context (prompt
                + continuation must leave one token of `max_model_len`), or token ids outside the vocabulary.
                Nothing is queued then.
        """
        eng = self.engine
        if eng.embedder is not None:
            raise ValueError("scoring needs task 'generate' (a model loaded with task 'embed' has no lm_head)")
        prompts = [prompts] if _is_single(prompts) else list(prompts)
        continuations = [continuations] if _is_single(continuations) else list(continuations)
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
        pairs = []
        for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
            try:
                ctx, cont = pair_token_ids(eng.tokenizer, p, c, add_special_tokens)
                eng.inputs.check_ids(ctx + cont)
            except ValueError as e:
                raise ValueError(f"pair {i}: {e}") from None
            if len(ctx) + len(cont) >= eng.max_model_len:
                raise ValueError(
                    f"pair {i}: prompt ({len(ctx)} tokens) + continuation ({len(cont)} tokens) does not fit the "
                    f"model's context of {eng.max_model_len} tokens (at most {eng.max_model_len - 1} can be scored)"
                )
            pairs.append((ctx, cont))
        params = scoring_params()
        ids = []
        try:
            for ctx, cont in pairs:
                rid = str(next(self._ids))
                eng.add_request(rid, {"prompt_token_ids": ctx + cont}, params, prompt_logprobs_from=len(ctx))
                ids.append(rid)
        except Exception:
            for rid in ids:
                eng.abort_request(rid)
            raise
        outs = self._run(ids, use_tqdm)
        return [continuation_score(o, len(ctx)) for o, (ctx, _) in zip(outs, pairs, strict=True)]

    # ------------------------------------------------------------------ embeddings
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed (task "embed"): one embedding per prompt (text, token ids or a prompt dict), in order,
        all prompts batched together. `pooling_params`: one for all or one per prompt (dimensions, normalize,
        truncate_prompt_tokens); `truncate_prompt_tokens` here applies to every prompt."""
        spec, eng = self.engine.pooling, self.engine
        if spec is None:
            raise ValueError(NOT_AN_EMBEDDING_ENGINE)
        prompts, plist = self._normalize(prompts, pooling_params or PoolingParams())
        if truncate_prompt_tokens is not None:
            plist = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in plist]
        name = self.config.served_model_name or resolve_model_path(self.config.model)
        ids = []
        for prompt, params in zip(prompts, plist, strict=True):
            params.verify(spec, name)
            prompt_ids = eng.inputs.prompt_ids(prompt)[1]
            ids.append(embedding_prompt_ids(prompt_ids, eng.max_model_len, params.truncate_prompt_tokens))
        pooled = eng.embed(ids)  # [n, hidden]
        return [
            EmbeddingRequestOutput(
                str(next(self._ids)), EmbeddingOutput(finish_embeddings(row[None], params, spec)[0].tolist()), p_ids
            )
            for row, params, p_ids in zip(pooled, plist, ids, strict=True)
        ]

    # ------------------------------------------------------------------ generation
    def _add(
        self,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        hooks: Hooks | None = None,
        hook_index: int = 0,
    ) -> str:
        rid = str(next(self._ids))
        self.engine.add_request(
            rid, prompt, params, priority=priority, lora_request=lora_request, hooks=hooks, hook_index=hook_index
        )
        return rid

    def _normalize(self, prompts, params) -> tuple[list[PromptType], list[SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        return prompts, plist

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        hooks: Hooks | Sequence[Hooks | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts at once through the batching engine; outputs in prompt order.

        Args:
            prompts: One prompt or a list: text, token ids, or a dict with "prompt" / "prompt_token_ids".
            sampling_params: One for all prompts or one per prompt.
            use_tqdm: Show a progress bar.
            priority: One per prompt, smaller served first (needs scheduling_policy="priority" unless all are 0),
                as in vLLM.
            hooks: Interventions (`netra_jax.Hooks`) run on the prompts' tokens in every step: one set for all
                prompts, or one per prompt (None: that prompt runs unhooked); `HookContext.request` is the prompt's
                index in `prompts`. Requests with other hooks, or none, share the steps (an edit changes only its
                own requests' rows). Recorded activations come back in `RequestOutput.activations` (and, for each
                of n samples, `CompletionOutput.activations`): {name: [positions, ...]}, row p for the token at
                position p of prompt + output (the last output token never runs through the model), padding
                removed. Hooked requests share no prefix-cache block with any other request; not with
                speculative decoding.
            lora_request: The LoRA adapter of every prompt, or one per prompt (None: the base model), as in vLLM;
                needs enable_lora. A bad adapter raises LoRAError (a ValueError naming the file or tensor).

        Returns:
            One RequestOutput per prompt, in order.
        """
        prompts, plist = self._normalize(prompts, sampling_params)
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        hook_sets = self._per_prompt(hooks, len(prompts), "hooks")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for i, (p, sp, prio, lora, h) in enumerate(zip(prompts, plist, priority, loras, hook_sets, strict=True)):
                ids.append(self._add(p, sp, prio, lora_request=lora, hooks=h, hook_index=i))
            return self._run(ids, use_tqdm)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise

    @staticmethod
    def _per_prompt(value, n: int, what: str) -> list:
        """One value for every prompt, or a sequence of one per prompt (ValueError on a length mismatch)."""
        if value is None or not isinstance(value, Sequence):
            return [value] * n
        if len(value) != n:
            raise ValueError(f"{len(value)} {what} for {n} prompts")
        return list(value)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        n_out, t0 = 0, time.perf_counter()
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            n_out += sum(len(o.token_ids) for o in out.outputs)
                            bar.set_postfix_str(f"output {n_out / (time.perf_counter() - t0):.1f} tok/s")
                            bar.update(1)
            self.engine.settle()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs of one request (`.outputs[i].delta_text` holds the new text)."""
        rid = self._add(prompt, sampling_params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            self.engine.settle()
                            return
        finally:
            self.engine.abort_request(rid)
