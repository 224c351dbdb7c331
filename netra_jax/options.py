"""The allowed values of the engine's options that name a choice (dtypes, load formats, tasks, pooling types,
scheduling policies, speculative methods). A leaf module: the config checks and the modules that act on a choice
import it; it imports nothing of netra_jax."""

from __future__ import annotations

__all__ = ["DTYPES", "LOAD_FORMATS", "POOLING_TYPES", "SCHEDULING_POLICIES", "SPEC_METHODS", "TASKS"]

DTYPES = ("auto", "float32", "bfloat16")  # the weights' and activations' float dtype ("auto": the checkpoint's)
LOAD_FORMATS = ("auto", "dummy")  # read the checkpoint | random weights of its shapes (benchmarks)
TASKS = ("generate", "embed")  # what a served model does: generate text | return pooled embeddings
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's sequence pooling types
SCHEDULING_POLICIES = ("fcfs", "priority")  # waiting order: arrival | (priority, arrival)
SPEC_METHODS = ("ngram", "draft_model")  # speculative decoding's proposers
