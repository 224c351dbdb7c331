"""The engine's command-line options (vLLM's flag names; `add_engine_args`) and their translation into an EngineConfig
(`engine_config`), shared by every command that builds an engine (`netra-jax serve`, `chat`, `generate`, `batch`);
building one from it (`load_engine`) reports a model that cannot be loaded as a one-line CLIError."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from netra_jax.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from netra_jax.ops.kv_quant import KV_CACHE_DTYPES
from netra_jax.options import SCHEDULING_POLICIES, TASKS

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine

__all__ = ["CLIError", "add_engine_args", "check_model", "engine_config", "load_engine", "one_line"]

log = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)")
    p.add_argument(
        "--tokenizer", default=None, help="a tokenizer directory, tokenizer.json or .gguf other than the model's"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a checkpoint whose config.json has an auto_map with the native implementation of its "
        "architecture (remote code is never run; a checkpoint whose architecture is not native is refused)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's type: auto = the weights' dtype; int8 / fp8 (= fp8_e4m3) / fp8_e5m2 keep a float32 scale "
        "per token and KV head (about 4x the tokens of float32 in the same memory)",
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes (CPU default 1 GiB)")
    p.add_argument("--num-kv-pages", type=int, default=None, help="explicit KV page count")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument(
        "--matmul-backend",
        default="auto",
        choices=("auto", "xla", "cpu_rows", "cpu_rows_q8", "gpu", "gpu_sm80", "gpu_interpret"),
        help="how matmuls run: auto = the CPU few-row kernel on CPU (built on first use; cpu_rows_q8: GGUF Q4_0 ... "
        "Q8_0 weights times activations rounded to int8 blocks, llama.cpp's arithmetic), the GPU kernels of "
        "quantized weights on CUDA (W4A16 / W8A16 Pallas; fp8 W8A8 on sm89+, W8A16 on older GPUs: gpu_sm80)",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
    p.add_argument("--max-waiting", type=int, default=None, help="cap of the waiting queue (then 429)")
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs: first come first served | priority: by each request's priority (lower first), then arrival; "
        "the lowest-priority running request is preempted when the KV cache runs out",
    )
    p.add_argument(
        "--align-chunks-to-buckets",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut the last prompt chunk of a step so the step ends on a compiled token bucket when that moves fewer "
        "tokens to the next step than it saves in padding (default: on for the CPU backend)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "fp8"],
        help="quantize a float checkpoint's weights at load: int8 / fp8 with per-channel scales, int4 as Q4_0 blocks "
        "(FP8, AWQ, GPTQ and compressed-tensors checkpoints are served as stored: leave it unset)",
    )
    p.add_argument(
        "--task",
        default="generate",
        choices=TASKS,
        help="generate: text generation | embed: an embedding model (POST /v1/embeddings; pooling from the "
        "checkpoint's sentence-transformers modules.json, else last token, L2-normalized)",
    )
    p.add_argument(
        "--pooler-config",
        default=None,
        help="--task embed: JSON overriding the checkpoint's pooling, e.g. "
        '\'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST | MEAN | CLS)',
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"model": DRAFT_DIR, "num_speculative_tokens": 4}\' '
        "(greedy and seeded outputs are unchanged); disable_by_batch_size: no proposals while more requests run "
        "(default 4; null: always)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every bucket at start")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM's flag: compile nothing ahead of time (as --no-warmup; each program compiles on first use)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs / prompt_logprobs a request may ask for (at most 20)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and pack step N+1 while step N runs on the device (hides the host's work per step)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights from the directory's config.json (benchmarks; outputs are noise)",
    )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags; a bad --pooler-config is a CLIError."""
    from netra_jax.engine_config import speculative_config_from
    from netra_jax.pooling import pooler_config_from

    try:
        pooler = pooler_config_from(a.pooler_config)
    except ValueError as e:
        raise CLIError(f"--pooler-config: {e}") from None
    try:
        speculative = speculative_config_from(a.speculative_config)
    except ValueError as e:
        raise CLIError(f"--speculative-config: {e}") from None
    try:
        return _engine_config(a, pooler, speculative)
    except ValueError as e:
        raise CLIError(one_line(e)) from None


def _engine_config(a: argparse.Namespace, pooler, speculative) -> EngineConfig:
    return EngineConfig(
        model=a.model or "",
        tokenizer=a.tokenizer,
        trust_remote_code=a.trust_remote_code,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        max_model_len=a.max_model_len,
        cache=CacheConfig(
            page_size=a.page_size,
            num_pages=a.num_kv_pages,
            kv_cache_bytes=a.kv_cache_memory,
            gpu_memory_utilization=a.gpu_memory_utilization,
            enable_prefix_caching=a.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_waiting=a.max_waiting,
            scheduling_policy=a.scheduling_policy,
            align_chunks_to_buckets=a.align_chunks_to_buckets,
        ),
        attention_backend=a.attention_backend,
        tensor_parallel_size=a.tensor_parallel_size,
        matmul_backend=a.matmul_backend,
        quantization=a.quantization,
        seed=a.seed,
        served_model_name=a.served_model_name,
        warmup=not (a.no_warmup or a.enforce_eager),
        load_format=a.load_format,
        task=a.task,
        pooler_config=pooler,
        async_scheduling=a.async_scheduling,
        speculative=speculative,
        max_logprobs=a.max_logprobs,
    )


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
    from netra_jax.api import build_engine, resolve_model_path

    try:
        return build_engine(config)
    except _LOAD_ERRORS as e:
        raise _cannot_load(resolve_model_path(config.model), e) from e


def check_model(config: EngineConfig) -> None:
    """Read the model's config and tokenizer (no weights), raising CLIError as `load_engine` does; for commands that
    load the model elsewhere (Ray workers)."""
    from netra_jax.api import resolve_model_path
    from netra_jax.loader import load_config
    from netra_jax.tokenizer import Tokenizer

    path = resolve_model_path(config.model)
    try:
        if config.load_format != "dummy":
            config.check_model(load_config(path, trust_remote_code=config.trust_remote_code))
        Tokenizer.load(config.tokenizer or path)
    except _LOAD_ERRORS as e:
        raise _cannot_load(path, e) from e
