"""Head-parallel attention under tensor parallelism: the PartitionSpecs of the attention's activations and of the
paged KV cache (split on heads over the mesh's "tp" axis), and `head_parallel`, which runs an attention kernel on each
device's own heads; `forward_mesh` and `auto_axes_layer`, which run the forward's layers on a mesh with Explicit axes
as on an Auto one. The rest of tensor parallelism (the mesh, parameter placement) is `netra_jax.parallel`."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from netra_jax.models.weight_map import TP
from netra_jax.ops.kv_quant import QuantizedPages

__all__ = ["HEADS", "KV_PAGES", "KV_SCALES", "auto_axes_layer", "forward_mesh", "head_parallel", "kv_specs"]

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


# ------------------------------------------------------------------------------------------ Explicit-axis meshes
# On a mesh whose "tp" axis is Explicit (`jax.make_mesh(..., axis_types=(AxisType.Explicit,))`) every array's type
# carries its sharding and each op must be able to infer its result's (a matmul over the split intermediate or head
# axis, a gather from the vocabulary-split embedding, a reshape of split heads cannot). The forward is written for
# Auto axes, where XLA propagates shardings, so each layer runs under `jax.sharding.auto_axes` on the same mesh typed
# Auto, and its results get the types they had on entry.


def forward_mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
    """The mesh the forward runs on: `mesh`; when None, the mesh of a `jax.set_mesh` / `jax.sharding.use_mesh`
    context that has a "tp" axis of Explicit type (an Auto one leaves XLA to place the work, as it always did)."""
    if mesh is not None:
        return mesh
    context = jax.sharding.get_abstract_mesh()
    return context if TP in context.explicit_axes else None


def _auto_view(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """mesh with every axis typed Auto: the same devices and axis names."""
    auto = {name: AxisType.Auto for name in mesh.axis_names}
    if isinstance(mesh, AbstractMesh):
        return mesh.update_axis_types(auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(auto.values()))


def auto_axes_layer(layer: Callable, mesh: Mesh | AbstractMesh | None, k_pages, v_pages) -> Callable:
    """A decoder layer fn(x, lp, k_pages, v_pages, *arrays, mesh=..., **static) -> (x, k_pages, v_pages, records),
    callable as it runs on `mesh`: itself when the mesh is None or Auto; on a mesh with Explicit axes, run under
    `jax.sharding.auto_axes` with mesh= the same mesh typed Auto (its shard_maps and XLA's propagation see the mesh
    they were written for), x and the records coming out replicated and the pages split on KV heads, as they
    came in. k_pages, v_pages: the layer's pages (their PartitionSpecs)."""
    if mesh is None or not mesh.explicit_axes:
        return layer
    auto = _auto_view(mesh)

    def on_auto(*args, **kwargs):
        return layer(*args, **{**kwargs, "mesh": auto})

    specs = (P(), kv_specs(k_pages), kv_specs(v_pages), P())
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    return jax.sharding.auto_axes(on_auto, axes=mesh.explicit_axes, out_sharding=shardings)
