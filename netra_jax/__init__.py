"""netra_jax: a JAX/XLA-compiled LLM inference runtime with a paged KV cache, continuous batching, Pallas attention
kernels and vLLM-compatible Python and OpenAI-compatible HTTP APIs."""

from netra_jax import paged
from netra_jax.api import LLM
from netra_jax.config import ModelConfig
from netra_jax.engine.factory import build_engine
from netra_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from netra_jax.engine_config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from netra_jax.inputs import PromptType, TextPrompt, TokensPrompt
from netra_jax.interventions import HookedOutput, ParamsUpdate
from netra_jax.lora_request import LoRARequest
from netra_jax.models.hooks import HookContext, Hooks, patch
from netra_jax.patching import CachedRun, PatchingSweep, patching_sweep
from netra_jax.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from netra_jax.sampling_params import SamplingParams, StructuredOutputsParams
from netra_jax.scoring import ContinuationScore

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "ContinuationScore",
    "Hooks",
    "HookContext",
    "HookedOutput",
    "CachedRun",
    "PatchingSweep",
    "patch",
    "patching_sweep",
    "ParamsUpdate",
    "LoRARequest",
    "LoRAConfig",
    "EngineConfig",
    "CacheConfig",
    "SchedulerConfig",
    "PoolerConfig",
    "SpeculativeConfig",
    "ModelConfig",
    "build_engine",
    "paged",
]
__version__ = "0.1.0"
