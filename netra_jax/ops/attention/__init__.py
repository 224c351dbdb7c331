"""Ragged paged attention over the paged KV cache: the one entry point `attention`, the KV write, the batch metadata
and the backends (`BACKENDS`), one module each. A flat ragged token batch (many sequences' new tokens concatenated)
attends to each sequence's pages through its block table.

Modules: `entry` (`attention`, differentiated as `dense.paged_attention_dense`), `registry` (`BACKENDS`,
`auto_backend`), `reference` (the jnp reference), `cpu` (the reference with the C++ kernel), `dense` (the
loop-free reference whose derivatives, forward and reverse mode, are every backend's), `metadata`
(`AttentionMetadata`), `work` (the host-side work lists), `write` (`write_kv`); the Pallas kernels are
`netra_jax.ops.paged_attention_mosaic` and `netra_jax.ops.paged_attention_triton`, an int8 / fp8 cache's storage
`netra_jax.ops.kv_quant`."""

from netra_jax.ops.attention.cpu import CPU_TOKEN_CONTEXT, cpu_backend, paged_attention_cpu
from netra_jax.ops.attention.dense import paged_attention_dense
from netra_jax.ops.attention.entry import attention
from netra_jax.ops.attention.metadata import (
    AttentionMetadata,
    AttentionWork,
    TokenLayout,
    token_layout,
    with_token_layout,
)
from netra_jax.ops.attention.reference import decode_chunks, paged_attention_reference
from netra_jax.ops.attention.registry import BACKENDS, auto_backend, backend_refuses_kv
from netra_jax.ops.attention.work import build_work, num_items
from netra_jax.ops.attention.write import write_kv

__all__ = [
    "BACKENDS",
    "CPU_TOKEN_CONTEXT",
    "AttentionMetadata",
    "AttentionWork",
    "TokenLayout",
    "attention",
    "auto_backend",
    "backend_refuses_kv",
    "build_work",
    "cpu_backend",
    "decode_chunks",
    "num_items",
    "paged_attention_cpu",
    "paged_attention_dense",
    "paged_attention_reference",
    "token_layout",
    "with_token_layout",
    "write_kv",
]
