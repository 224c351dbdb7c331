"""The engine's command-line options (vLLM's flag names; `add_engine_args`) and their translation into an EngineConfig
(`engine_config`), shared by every command that builds an engine (`netra-jax serve`, `chat`, `generate`, `batch`);
building one from it (`load_engine`) reports a model that cannot be loaded as a one-line CLIError."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from netra_jax.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, speculative_config_from
from netra_jax.ops.kv_quant import KV_CACHE_DTYPES
from netra_jax.options import DTYPES, LOAD_FORMATS, SCHEDULING_POLICIES, TASKS
from netra_jax.quant import MATMULS, METHODS

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine

__all__ = [
    "CLIError",
    "EngineArgs",
    "add_engine_args",
    "check_model",
    "engine_args",
    "engine_config",
    "load_engine",
    "one_line",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options as flat values under vLLM's names, each with its one default: what `LLM(...)`, the
    command line's engine flags (`add_engine_args`) and Ray Serve's application arguments all take.
    `create_engine_config` turns them into the checked EngineConfig. `LLM` differs in one default, on purpose:
    `warmup=False` (an offline job compiles each program on first use; a server compiles them all before it is
    ready). warmup None: on unless `enforce_eager`."""

    model: str | None = None  # a HF directory or .gguf file; None: the embedded default model
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int | None = None
    scheduling_policy: str = "fcfs"
    align_chunks_to_buckets: bool | None = None
    page_size: int = 16
    num_kv_pages: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    matmul_backend: str = "auto"
    quantization: str | None = None
    seed: int = 0
    served_model_name: str | None = None
    compilation_cache_dir: str | None = None
    compiled: str | None = None  # a bundle of compiled programs (`netra-jax compile`)
    warmup: bool | None = None
    enforce_eager: bool = False
    load_format: str = "auto"
    task: str = "generate"
    pooler_config: Any = None  # PoolerConfig, its dict or JSON text
    async_scheduling: bool = True
    speculative_config: Any = None  # SpeculativeConfig, vLLM's dict or its JSON text
    max_logprobs: int = 20
    enable_lora: bool = False  # serve LoRA adapters (netra_jax/engine/lora_slots.py)
    max_loras: int = 1  # adapters on the device at once
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read on the host; None: max_loras
    batch_invariant: bool = False  # every step on the row-invariant CPU kernels (netra_jax/rl.py's numerics)

    @classmethod
    def from_strings(cls, options: dict[str, Any]) -> EngineArgs:
        """EngineArgs from options given as text (Ray Serve's application arguments, `serve run ... key=value`):
        each converted to its field's type ("true" / "false" / "1" / "0" for flags, "" or None: the default).
        Unknown names are a ValueError naming them."""
        types = {f.name: str(f.type) for f in fields(cls)}
        unknown = sorted(set(options) - set(types))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(types)}")
        values = {}
        for name, value in options.items():
            if value is None or value == "":
                continue
            kind = types[name]
            if isinstance(value, str) and kind.startswith("bool"):
                value = value.strip().lower() not in ("0", "false", "no", "off")
            elif isinstance(value, str) and kind.startswith(("int", "float")):
                value = (int if kind.startswith("int") else float)(value)
            values[name] = value  # text options (and values not given as text) as they are
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig of these options (ValueError, e.g. ConfigError, naming a bad one)."""
        from netra_jax.pooling import pooler_config_from

        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.enforce_eager and self.warmup is True:
            raise ValueError(
                "enforce_eager=True compiles nothing ahead of time; it cannot be combined with warmup=True"
            )
        attention_backend, matmul_backend = self.kernel_backends()
        return EngineConfig(
            model=str(self.model) if self.model else "",
            tokenizer=str(self.tokenizer) if self.tokenizer is not None else None,
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len,
            cache=CacheConfig(
                page_size=self.page_size,
                num_pages=self.num_kv_pages,
                kv_cache_bytes=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_waiting=self.max_waiting,
                scheduling_policy=self.scheduling_policy,
                align_chunks_to_buckets=self.align_chunks_to_buckets,
            ),
            attention_backend=attention_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            matmul_backend=matmul_backend,
            quantization=self.quantization,
            seed=self.seed,
            served_model_name=self.served_model_name,
            compilation_cache_dir=self.compilation_cache_dir,
            compiled=str(self.compiled) if self.compiled is not None else None,
            warmup=not self.enforce_eager if self.warmup is None else self.warmup,
            load_format=self.load_format,
            task=self.task,
            pooler_config=pooler_config_from(self.pooler_config),
            async_scheduling=self.async_scheduling,
            speculative=speculative_config_from(self.speculative_config),
            max_logprobs=self.max_logprobs,
            lora=self.lora_config(),
        )

    def kernel_backends(self) -> tuple[str, str]:
        """(attention backend, matmul backend): as given, or with batch_invariant the batch-invariant CPU kernels
        ("cpu_invariant" both), under which a request's logits, and so its sampled tokens' raw and processed
        logprobs, do not depend on the batch around it, on chunked prefill, prefix-cache hits or preemption, and equal
        `netra_jax.rl.sequence_logprobs`' bit for bit. ValueError for options it cannot honour."""
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if not self.batch_invariant:
            return self.attention_backend, self.matmul_backend
        for name in ("attention_backend", "matmul_backend"):
            if getattr(self, name) not in ("auto", "cpu_invariant"):
                raise ValueError(
                    f"batch_invariant runs the 'cpu_invariant' kernels; {name}={getattr(self, name)!r} conflicts "
                    "(leave it 'auto')"
                )
        if self.tensor_parallel_size != 1 or self.enable_lora:
            raise ValueError("batch_invariant runs one unsplit model on CPU, without LoRA adapters")
        return "cpu_invariant", "cpu_invariant"

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA options as a LoRAConfig when enable_lora, else None (the other LoRA options then unused)."""
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)


_DEFAULTS = EngineArgs()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=_DEFAULTS.model, help="HF model directory or .gguf file (default: SmolLM2-135M)"
    )
    p.add_argument(
        "--tokenizer",
        default=_DEFAULTS.tokenizer,
        help="a tokenizer directory, tokenizer.json or .gguf other than the model's",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a checkpoint whose config.json has an auto_map with the native implementation of its "
        "architecture (remote code is never run; a checkpoint whose architecture is not native is refused)",
    )
    p.add_argument("--dtype", default=_DEFAULTS.dtype, choices=DTYPES)
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--page-size", type=int, default=_DEFAULTS.page_size, help="tokens per KV page")
    p.add_argument(
        "--kv-cache-dtype",
        default=_DEFAULTS.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's type: auto = the weights' dtype; int8 / fp8 (= fp8_e4m3) / fp8_e5m2 keep a float32 scale "
        "per token and KV head (about 4x the tokens of float32 in the same memory)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=_DEFAULTS.kv_cache_memory,
        help="KV cache size in bytes (CPU default 1 GiB)",
    )
    p.add_argument("--num-kv-pages", type=int, default=_DEFAULTS.num_kv_pages, help="explicit KV page count")
    p.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=_DEFAULTS.enable_prefix_caching
    )
    p.add_argument("--attention-backend", default=_DEFAULTS.attention_backend)
    p.add_argument(
        "--matmul-backend",
        default=_DEFAULTS.matmul_backend,
        choices=("auto", *MATMULS),
        help="how matmuls run: auto = the C++ kernels on CPU (cpu_rows_q8 for a GGUF file: its blocks times "
        "activations rounded to int8 blocks, llama.cpp's arithmetic; cpu_rows for a Hugging Face checkpoint, or on "
        "request: float32 activations, the de-quantized weights' arithmetic), the GPU kernels of "
        "quantized weights on CUDA (W4A16 / W8A16 Pallas; fp8 W8A8 on sm89+, W8A16 on older GPUs: gpu_sm80)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_DEFAULTS.tensor_parallel_size,
        help="devices to split the model over",
    )
    p.add_argument("--max-waiting", type=int, default=_DEFAULTS.max_waiting, help="cap of the waiting queue (then 429)")
    p.add_argument(
        "--scheduling-policy",
        default=_DEFAULTS.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fcfs: first come first served | priority: by each request's priority (lower first), then arrival; "
        "the lowest-priority running request is preempted when the KV cache runs out",
    )
    p.add_argument(
        "--align-chunks-to-buckets",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.align_chunks_to_buckets,
        help="cut the last prompt chunk of a step so the step ends on a compiled token bucket when that moves fewer "
        "tokens to the next step than it saves in padding (default: on for the CPU backend)",
    )
    p.add_argument(
        "--quantization",
        default=_DEFAULTS.quantization,
        choices=METHODS,
        help="quantize a float checkpoint's weights at load: int8 / fp8 with per-channel scales, int4 as Q4_0 blocks "
        "(FP8, AWQ, GPTQ and compressed-tensors checkpoints are served as stored: leave it unset)",
    )
    p.add_argument(
        "--task",
        default=_DEFAULTS.task,
        choices=TASKS,
        help="generate: text generation | embed: an embedding model (POST /v1/embeddings; pooling from the "
        "checkpoint's sentence-transformers modules.json, else last token, L2-normalized)",
    )
    p.add_argument(
        "--pooler-config",
        default=_DEFAULTS.pooler_config,
        help="--task embed: JSON overriding the checkpoint's pooling, e.g. "
        '\'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST | MEAN | CLS)',
    )
    p.add_argument(
        "--speculative-config",
        default=_DEFAULTS.speculative_config,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"model": DRAFT_DIR, "num_speculative_tokens": 4}\' '
        "(greedy and seeded outputs are unchanged); disable_by_batch_size: no proposals while more requests run "
        "(default 4; null: always)",
    )
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--served-model-name", default=_DEFAULTS.served_model_name)
    p.add_argument(
        "--compilation-cache-dir",
        default=_DEFAULTS.compilation_cache_dir,
        help="persistent XLA compilation cache (default $JAX_COMPILATION_CACHE_DIR, else the cache dir's xla/; '' off)",
    )
    p.add_argument(
        "--compiled",
        default=_DEFAULTS.compiled,
        metavar="DIR",
        help="load the programs `netra-jax compile` wrote to DIR instead of compiling them (when they match this "
        "engine; else a warning says what differs and they compile); without --num-kv-pages the KV cache takes the "
        "bundle's size when it was compiled for this device",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every bucket at start")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM's flag: compile nothing ahead of time (as --no-warmup; each program compiles on first use)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=_DEFAULTS.max_logprobs,
        help="the most logprobs / prompt_logprobs a request may ask for (at most 20)",
    )
    p.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters over the base model (PEFT directories)"
    )
    p.add_argument(
        "--max-loras", type=int, default=_DEFAULTS.max_loras, help="LoRA adapters held on the device at once"
    )
    p.add_argument("--max-lora-rank", type=int, default=_DEFAULTS.max_lora_rank, help="the largest LoRA rank served")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=_DEFAULTS.max_cpu_loras,
        help="LoRA adapters kept read on the host (default: --max-loras); more are read again when needed",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.async_scheduling,
        help="schedule and pack step N+1 while step N runs on the device (hides the host's work per step)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="run every step on the row-invariant CPU kernels: a request's logits and logprobs do not depend on its "
        "batch, chunking, prefix-cache hits or preemption, and equal netra_jax.rl.sequence_logprobs bit for bit "
        "(slower; CPU only)",
    )
    p.add_argument(
        "--load-format",
        default=_DEFAULTS.load_format,
        choices=LOAD_FORMATS,
        help="dummy: random weights from the directory's config.json (benchmarks; outputs are noise)",
    )


def engine_args(a: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of parsed engine flags (`add_engine_args`)."""
    return EngineArgs(
        **{f.name: getattr(a, f.name) for f in fields(EngineArgs) if f.name not in ("warmup", "enforce_eager")},
        warmup=False if a.no_warmup else None,
        enforce_eager=a.enforce_eager,
    )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags; a bad option is a CLIError in one line (naming the flag for the
    JSON ones, parsed here first)."""
    from netra_jax.pooling import pooler_config_from

    parsed = {}
    for flag, name, parse in (
        ("--pooler-config", "pooler_config", pooler_config_from),
        ("--speculative-config", "speculative_config", speculative_config_from),
    ):
        try:
            parsed[name] = parse(getattr(a, name))
        except ValueError as e:
            raise CLIError(f"{flag}: {e}") from None
    try:
        return dataclasses.replace(engine_args(a), **parsed).create_engine_config()
    except ValueError as e:
        raise CLIError(one_line(e)) from None


class CLIError(Exception):
    """A command cannot go on (the model does not load, no chat template): `main` prints it in one line, exits 2."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line; its type leads unless it is the usual OSError / ValueError."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {text}"


# What a model that cannot be loaded raises: missing or unreadable files (OSError, FileNotFoundError), a damaged,
# refused or unsupported checkpoint, config or tokenizer (ValueError: CheckpointError, ConfigError, the tokenizer's and
# the GGUF reader's errors), a checkpoint larger than memory. Anything else is a bug of ours and keeps its traceback.
_LOAD_ERRORS = (OSError, ValueError, MemoryError)


def _cannot_load(path: object, e: BaseException) -> CLIError:
    """The one line for the user; the traceback goes to the debug log (`--log-level DEBUG`)."""
    log.debug("cannot load the model %s", path, exc_info=e)
    return CLIError(f"cannot load the model {path}: {one_line(e)}")


def load_engine(config: EngineConfig) -> LLMEngine:
    """`build_engine(config)`; a model that cannot be loaded (missing, not a model, an unsupported architecture or
    tokenizer, a damaged file) raised as CLIError."""
    from netra_jax.engine.factory import build_engine, resolve_model_path

    try:
        return build_engine(config)
    except _LOAD_ERRORS as e:
        raise _cannot_load(resolve_model_path(config.model), e) from e


def check_model(config: EngineConfig) -> None:
    """Read the model's config and tokenizer (no weights), raising CLIError as `load_engine` does; for commands that
    load the model elsewhere (Ray workers)."""
    from netra_jax.engine.factory import resolve_model_path
    from netra_jax.loader import load_config
    from netra_jax.tokenization.tokenizer import Tokenizer

    path = resolve_model_path(config.model)
    try:
        if config.load_format != "dummy":
            config.check_model(load_config(path, trust_remote_code=config.trust_remote_code))
        Tokenizer.load(config.tokenizer or path)
    except _LOAD_ERRORS as e:
        raise _cannot_load(path, e) from e
