"""Head-parallel attention under tensor parallelism: the PartitionSpecs of the attention's activations and of the
paged KV cache (split on heads over the mesh's "tp" axis), and `head_parallel`, which runs an attention kernel on each
device's own heads. The rest of tensor parallelism (the mesh, parameter placement) is `netra_jax.parallel`."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from netra_jax.models.weight_map import TP
from netra_jax.ops.kv_quant import QuantizedPages

__all__ = ["HEADS", "KV_PAGES", "KV_SCALES", "head_parallel", "kv_specs"]

HEADS = P(None, TP, None)  # [T, heads, head_dim] activations
KV_PAGES = P(None, None, TP, None)  # [num_pages, page_size, kv_heads, head_dim]
KV_SCALES = P(None, None, TP)  # [num_pages, page_size, kv_heads] scales of an int8 / fp8 cache


def kv_specs(pages) -> P | QuantizedPages:
    """The PartitionSpec (pytree) of one layer's K or V cache: split on kv_heads; a quantized cache's scales
    [num_pages, page_size, kv_heads] split the same way."""
    if isinstance(pages, QuantizedPages):
        return QuantizedPages(values=KV_PAGES, scales=KV_SCALES)
    return KV_PAGES


def head_parallel(fn: Callable, mesh: Mesh) -> Callable:
    """Run fn(q, k, v, k_pages, v_pages, md, sinks) -> (o, k_pages, v_pages) on each device's own heads: q/k/v/o
    [T, heads, head_dim], the pages (and a quantized cache's scales) and the attention sinks [heads] (or None) are
    split on their heads axis, the metadata is replicated. Heads are independent, so no KV crosses devices, and a
    Pallas kernel (which XLA cannot partition) sees plain local arrays."""

    def run(q, k, v, k_pages, v_pages, md, sinks):
        kv = kv_specs(k_pages)
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(HEADS, HEADS, HEADS, kv, kv, P(), P(TP)),
            out_specs=(HEADS, kv, kv),
            check_vma=False,
        )(q, k, v, k_pages, v_pages, md, sinks)

    return run
