"""The engine's options, as frozen dataclasses checked when built (so a bad option fails before any weight is read,
on every way in): the KV cache, the scheduler, embedding pooling, speculative decoding, LoRA adapters and the engine
itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from netra_jax.config import ConfigError, ModelConfig, json_object
from netra_jax.options import DTYPES, LOAD_FORMATS, POOLING_TYPES, SCHEDULING_POLICIES, SPEC_METHODS, TASKS


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(name: str, v: object, lo: int = 1, *, optional: bool = False) -> None:
    """ConfigError unless `v` is an integer >= `lo` (or None when `optional`)."""
    if optional and v is None:
        return
    if not _is_int(v) or v < lo:
        rule = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ConfigError(f"{name} must be {rule}{' or None' if optional else ''}, got {v!r}")


def check_choice(name: str, v: object, choices: tuple | list | dict, *, optional: bool = False) -> None:
    """ConfigError unless `v` is one of `choices` (or None when `optional`), naming them."""
    if optional and v is None:
        return
    if not isinstance(v, str) or v not in choices:
        names = ", ".join(choices)
        raise ConfigError(f"{name} must be {'None or ' if optional else ''}one of {names}, got {v!r}")


def check_bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be True or False, got {v!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served over the base model (vLLM's --enable-lora options; netra_jax/engine/lora_slots.py)."""

    max_loras: int = 1  # adapters held on the device at once (slots), so at most this many distinct ones per step
    max_lora_rank: int = 16  # the largest rank served: every slot is padded to it
    max_cpu_loras: int | None = None  # adapters kept read on the host (LRU); None: max_loras

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)
        check_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # explicit page count; else derived from the memory budget
    kv_cache_bytes: int | None = None  # byte budget for the KV array (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.9  # fraction of accelerator memory for weights + KV
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size)
        check_int("num_kv_pages", self.num_pages, 2, optional=True)
        check_int("kv_cache_memory", self.kv_cache_bytes, optional=True)
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0.0 < u <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # token budget per step (chunked prefill above it)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_waiting: int | None = None  # queue cap; None = unbounded
    scheduling_policy: str = "fcfs"  # fcfs | priority: waiting order (priority, arrival), lowest priority preempted
    # cut the last prompt chunk admitted to a step so the step ends on a token bucket, when that moves fewer tokens
    # to the next step than it saves in padding (engine/buckets.py fit_chunk). None: on for the CPU backend, where a
    # step costs in proportion to its padded size (`for_platform`)
    align_chunks_to_buckets: bool | None = None
    # distinct LoRA adapters running at once (the engine's device slots); a request of another adapter waits until
    # one of them has no running request. None: no adapters (LoRAConfig sets it)
    max_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_loras", self.max_loras, optional=True)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_model_len", self.max_model_len, optional=True)
        check_int("max_waiting", self.max_waiting, optional=True)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.align_chunks_to_buckets is not None:
            check_bool("align_chunks_to_buckets", self.align_chunks_to_buckets)

    def for_platform(self, platform: str) -> SchedulerConfig:
        """This config with the settings left to the platform (jax.default_backend(): "cpu", "gpu", ...) filled in."""
        if self.align_chunks_to_buckets is None:
            return dataclasses.replace(self, align_chunks_to_buckets=platform == "cpu")
        return self


@dataclass(frozen=True)
class PoolerConfig:
    """How task "embed" turns a sequence's final-normed hidden states into one vector (vLLM's --pooler-config).
    A field left None comes from the checkpoint's sentence-transformers modules (modules.json), else from vLLM's
    embedding default: LAST token, L2-normalized."""

    pooling_type: str | None = None  # one of POOLING_TYPES
    normalize: bool | None = None  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # HF directory or .gguf file; "" = the embedded default model
    dtype: str = "auto"  # auto | float32 | bfloat16
    # the KV cache's type, vLLM's --kv-cache-dtype: auto (the parameters' dtype) | float32 | bfloat16 | int8 | fp8
    # (= fp8_e4m3) | fp8_e5m2; int8 / fp8 keep one float32 scale per (token, KV head) (netra_jax/ops/kv_quant.py)
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"  # auto | reference | triton | ...
    tensor_parallel_size: int = 1  # devices the weights and KV heads are split over (netra_jax.parallel)
    # how matmuls run (netra_jax/quant/matmul.py BACKENDS): auto = the CPU kernels on CPU when they build
    # ("cpu_rows_q8" for a GGUF file: its blocks times int8-rounded activations, llama.cpp's arithmetic; "cpu_rows"
    # for a Hugging Face checkpoint: float activations), the GPU kernels of quantized weights on CUDA ("gpu": W4A16 /
    # W8A16 Pallas, fp8 W8A8, on sm89+; "gpu_sm80": fp8 as W8A16), XLA's dot otherwise and whenever the weights are
    # split | xla | cpu_rows | cpu_rows_q8 (CPU only) | gpu | gpu_sm80 (CUDA only) | gpu_interpret
    matmul_backend: str = "auto"
    quantization: str | None = None  # None | "int8" | "int4" | "fp8" (weight-only, at load; netra_jax/quant/online.py)
    seed: int = 0  # seeds requests that give none
    served_model_name: str | None = None
    compilation_cache_dir: str | None = None  # persistent XLA cache; None = <cache dir>/xla, "" = off
    # a directory `netra-jax compile` wrote (netra_jax/engine/bundle.py): its programs are loaded instead of compiled
    # when they match this engine (else a one-line warning says what differs, and they compile as usual)
    compiled: str | None = None
    # compile every reachable program before serving (engine/warmup.py; the server's readiness guarantee). False:
    # each program compiles on its first use (LLM's default: construction returns in seconds)
    warmup: bool = True
    async_scheduling: bool = True  # overlap: schedule step N+1 while step N runs (engine/engine.py)
    load_format: str = "auto"  # auto: read the weights | dummy: random weights from config.json (benchmarks)
    task: str = "generate"  # one of TASKS; "embed": no lm_head, pooled embeddings (netra_jax/engine/embedder.py)
    pooler_config: PoolerConfig | None = None  # task "embed": overrides of the checkpoint's pooling
    speculative: SpeculativeConfig | None = None  # speculative decoding (netra_jax/engine/spec); None: off
    tokenizer: str | None = None  # a tokenizer directory, tokenizer.json or .gguf other than the model's; None: its own
    # load a checkpoint whose config.json has an auto_map, with the native implementation of its architecture
    # (remote code is never run: a checkpoint whose architecture is not native is refused whatever this says)
    trust_remote_code: bool = False
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default 20)
    lora: LoRAConfig | None = None  # LoRA adapters (enable_lora); None: the base model only

    def __post_init__(self) -> None:
        """Check every option now, so a bad one fails with a clear message before any weight is read."""
        from netra_jax.ops.attention import BACKENDS, backend_refuses_kv
        from netra_jax.ops.kv_quant import KV_CACHE_DTYPES
        from netra_jax.ops.sampling_batch import MAX_LOGPROBS
        from netra_jax.quant import MATMULS, METHODS

        for name in ("model", "served_model_name", "compilation_cache_dir", "tokenizer", "compiled"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{name} must be a string{'' if name == 'model' else ' or None'}, got {v!r}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_int("max_model_len", self.max_model_len, optional=True)
        if not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        check_choice("attention_backend", self.attention_backend, BACKENDS)
        why = backend_refuses_kv(self.attention_backend, self.kv_cache_dtype)
        if why:
            raise ConfigError(why)
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        check_choice("matmul_backend", self.matmul_backend, ("auto", *MATMULS))
        whole = ("cpu_rows", "cpu_rows_q8", "gpu", "gpu_sm80", "gpu_interpret")
        if self.matmul_backend in whole and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"matmul_backend {self.matmul_backend!r} takes whole weights; with tensor_parallel_size > 1 use 'auto' "
                "or 'xla'"
            )
        check_choice("quantization", self.quantization, METHODS, optional=True)
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        for name in ("warmup", "async_scheduling", "trust_remote_code"):
            check_bool(name, getattr(self, name))
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("task", self.task, TASKS)
        if self.pooler_config is not None:
            if not isinstance(self.pooler_config, PoolerConfig):
                raise ConfigError(f"pooler_config must be a PoolerConfig, got {type(self.pooler_config).__name__}")
            if self.task != "embed":
                raise ConfigError("pooler_config applies to task 'embed' only")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
        if self.lora is not None:
            if not isinstance(self.lora, LoRAConfig):
                raise ConfigError(f"lora must be a LoRAConfig, got {type(self.lora).__name__}")
            if self.task != "generate" or self.speculative is not None:
                raise ConfigError(
                    "LoRA adapters are served with task 'generate' without speculative decoding (not yet with "
                    "embeddings or speculation)"
                )
        if not _is_int(self.max_logprobs) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError(
                f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the top logprobs the compiled sampler "
                f"computes), got {self.max_logprobs!r}"
            )

    def check_model(self, model: ModelConfig) -> None:
        """ConfigError unless these options suit `model` (read from its headers: no weight is needed)."""
        if self.max_model_len and self.max_model_len > model.max_context:
            raise ConfigError(
                f"max_model_len={self.max_model_len} is longer than the model's context of {model.max_context}"
                " tokens (max_position_embeddings, or YaRN's original context times its factor)"
            )

    def resolved_backend(self, platform: str | None = None) -> str:
        """The attention backend the steps run on `platform` (jax.default_backend() when None); ConfigError for a
        GPU kernel asked for off GPU."""
        if platform is None:
            import jax

            platform = jax.default_backend()
        if self.attention_backend in ("triton", "mosaic") and platform != "gpu":
            raise ConfigError(
                f"attention_backend {self.attention_backend!r} needs a GPU (this platform is {platform}); "
                f"use 'auto' or 'reference', or '{self.attention_backend}_interpret' to run the kernel interpreted"
            )
        if self.attention_backend != "auto":
            return self.attention_backend
        if platform == "cpu":
            from netra_jax.ops.attention import cpu_backend

            return cpu_backend()
        # on GPU the choice needs the dtype and head shapes, which each attention call has: "auto" runs Mosaic GPU on
        # Hopper for bf16/fp16 and the shapes it takes, Triton otherwise (ops.attention.auto_backend)
        return "auto" if platform == "gpu" else "reference"

    def resolved_matmul_backend(self, platform: str | None = None, compute_capability: str | None = None) -> str:
        """The matmul backend the steps run on `platform` (jax.default_backend() when None), building the CPU kernel
        when it is wanted; ConfigError for "cpu_rows" / "cpu_rows_q8" off CPU or when the kernel cannot be built,
        and for the GPU backends off GPU. On GPU "auto" is "gpu" where the GPU multiplies in fp8
        (`compute_capability` 8.9 and above; the first device's when None), "gpu_sm80" on older ones, XLA's dot when
        the weights are split."""
        import jax

        from netra_jax.ops import cpu_kernels
        from netra_jax.ops.fp8_matmul import has_fp8
        from netra_jax.quant import CPU_BACKENDS, GPU_BACKENDS

        platform = platform or jax.default_backend()
        if self.matmul_backend in CPU_BACKENDS:
            mb = self.matmul_backend
            if platform != "cpu":
                raise ConfigError(f"matmul_backend {mb!r} is a CPU kernel (this platform is {platform})")
            if not cpu_kernels.available():
                raise ConfigError(f"matmul_backend {mb!r}: {cpu_kernels.unavailable_reason()}")
            return mb
        if self.matmul_backend in GPU_BACKENDS and platform != "gpu":
            raise ConfigError(
                f"matmul_backend {self.matmul_backend!r} needs a GPU (this platform is {platform}); use 'auto', "
                "'xla' or 'gpu_interpret'"
            )
        if self.matmul_backend != "auto":
            return self.matmul_backend
        if self.tensor_parallel_size > 1 or platform not in ("cpu", "gpu"):
            return "xla"
        if platform == "gpu":
            cc = compute_capability or getattr(jax.devices()[0], "compute_capability", None)
            return "gpu" if has_fp8(cc) else "gpu_sm80"
        if not cpu_kernels.available():
            return "xla"
        # a GGUF file runs llama.cpp's arithmetic (activations rounded to int8 blocks of 32: 1.1-3.5x faster
        # products, text scored as llama.cpp scores it, see ops/cpu_ggml_matmul.py); a Hugging Face checkpoint keeps
        # float activations (W4A16 / W8A16 for GPTQ, AWQ and --quantization), the arithmetic its authors ran
        return "cpu_rows_q8" if self.serves_gguf() else "cpu_rows"

    def serves_gguf(self) -> bool:
        """Whether the model is a GGUF file (the embedded default model is one)."""
        from netra_jax.loader.gguf_loader import is_gguf_file

        if not self.model:
            return True
        try:
            return is_gguf_file(self.model)
        except OSError:  # a file that cannot be read: the loader says why
            return False


# ---------------------------------------------------------------- speculative decoding (vLLM's speculative_config)

_DEFAULT_LOOKUP = 5  # vLLM's n-gram window when neither bound is given
# Proposals stop while more requests than this run, unless the config says otherwise (None: never stop). On 2 CPU
# cores (SmolLM2, n-gram k 5) speculation gained 1.49x at 1 request on grounded prompts and 1.18x on free-form chat,
# and at 8 requests 1.13x on grounded prompts but 0.93x on chat: each verification widens a step that already costs
# about in proportion to its tokens (benchmarks/results/2026-12-02-spec_decode_batch*.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": the proposal is the k tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). method "draft_model": `model`
    (same tokenizer as the target) proposes k tokens greedily. disable_by_batch_size: no proposals while more
    requests than this are running (vLLM's option; default DEFAULT_DISABLE_BY_BATCH_SIZE, where vLLM's is None;
    None, or null in JSON: always speculate)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
            if self.model is not None:
                raise ConfigError("method 'ngram' takes no draft model; give {'model': path} for a draft model")
        elif not self.model:
            raise ConfigError("method 'draft_model' needs 'model': the path of a draft checkpoint")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(f"disable_by_batch_size must be a positive integer or None, got {d!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m} or {"model": path, "num_speculative_tokens": k} (method "draft_model" implied).
        One lookup bound given alone sets both, as vLLM does. Unknown keys raise ConfigError."""
        d = json_object(d, "speculative config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        kw = dict(d)
        if "num_speculative_tokens" not in kw:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        if kw.get("method") is None:
            kw["method"] = "draft_model" if kw.get("model") else "ngram"
        lo, hi = kw.get("prompt_lookup_min"), kw.get("prompt_lookup_max")
        if lo is None and hi is not None:
            kw["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            kw["prompt_lookup_max"] = lo
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if kw.get(key) is None:
                kw.pop(key, None)
        return cls(**kw)


def speculative_config_from(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from what users pass: the object, vLLM's dict, its JSON text (the CLI flag), or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_dict(json_object(value, "speculative config"))
