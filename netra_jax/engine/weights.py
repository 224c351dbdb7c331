"""The engine's weights and KV memory over time: a caller's parameter tree checked and placed as the live weights
are (`update_params`), and what sleeping keeps of each runner's KV cache and weights to restore them (`sleep`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.models.frozen_params import unfreeze
from netra_jax.models.transformer import fuse_qkv
from netra_jax.quant import weight_layout


def layout(tree):
    """Each array of `tree` as a ShapeDtypeStruct with its sharding (what it takes to place or allocate it again)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def placed_like(old, params, backend: str | None = None):
    """`params` (any mappings and sequences, e.g. a frozen view or a tree mapped over one; or `load_model`'s layout
    with q, k and v apart when `old` holds them joined) as a tree of `old`'s structure, each leaf with the old leaf's
    dtype and sharding: no copy where they already agree, a float leaf of another float dtype cast, one elsewhere
    moved, q/k/v joined (the one concatenation). `backend`: the matmul backend `old` was laid out for, whose layout
    (`quant.weight_layout`, e.g. Q4_K rows interleaved for "cpu_rows_q8") the new weights get first (a no-op for
    weights already in it). `old` may be a tree of arrays or of ShapeDtypeStructs. ValueError naming the first leaf
    that does not fit, or for another structure."""
    old_leaves, treedef = jax.tree.flatten_with_path(old)
    params = unfreeze(params)
    if backend is not None:
        params = weight_layout(params, backend)
    new_leaves, new_def = jax.tree.flatten_with_path(params)
    joined = any("wqkv" in lp for lp in old.get("layers", ()))
    if new_def != treedef and joined and isinstance(params, dict) and isinstance(params.get("layers"), list):
        # q, k and v apart, as `load_model` gives them, for an engine that holds them joined (CPU): join them too
        new_leaves, new_def = jax.tree.flatten_with_path(fuse_qkv(params))
    if new_def != treedef:
        raise ValueError(f"new params do not have the structure of the model's pytree: {new_def} vs {treedef}")
    placed = []
    for (path, a), (_, b) in zip(old_leaves, new_leaves, strict=True):
        dtype = np.dtype(getattr(b, "dtype", None))
        floats = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(a.dtype, jnp.floating)
        if np.shape(b) != a.shape or (dtype != a.dtype and not floats):
            name = jax.tree_util.keystr(path)
            raise ValueError(
                f"params{name}: expected {a.dtype}{list(a.shape)}, got {getattr(b, 'dtype', type(b).__name__)}"
                f"{list(np.shape(b))}"
            )
        placed.append(jax.device_put(b, a.sharding).astype(a.dtype))  # both no-ops when they agree
    return jax.tree.unflatten(treedef, placed)


class Sleep:
    """What a sleeping engine keeps of its runners (the engine's, then a draft model's): each KV cache's layout
    (level 1: the arrays deleted) and each runner's weights as host arrays with their device layout (level 2)."""

    def __init__(self) -> None:
        self.kv: list | None = None  # each runner's KV cache layout while it sleeps
        self.weights: list | None = None  # each runner's (host weights, their device layout) at level 2

    @property
    def asleep(self) -> bool:
        return self.kv is not None or self.weights is not None

    def sleep(self, runners: Sequence, level: int) -> None:
        """Delete the runners' KV caches (and, at level 2, move their weights to host); deeper than now adds level
        2's part."""
        if self.kv is None:
            self.kv = [layout(r.kv) for r in runners]
            for r in runners:
                for a in jax.tree.leaves(r.kv):
                    a.delete()
                r.kv = None
        if level == 2 and self.weights is None:
            self.weights = [(jax.device_get(r.params), layout(r.params)) for r in runners]
            for r in runners:
                r.params = None

    def wake_weights(self, runners: Sequence, first: int = 0) -> None:
        """Put the sleeping weights back on the devices, from runner `first` on (1: the main model's were replaced
        by `update_params`), and count them awake."""
        for r, (host, lay) in list(zip(runners, self.weights, strict=True))[first:]:
            r.params = jax.tree.map(lambda h, s: jax.device_put(h, s.sharding), host, lay)
        self.weights = None

    def wake_kv(self, runners: Sequence) -> None:
        """Allocate the runners' KV caches again, zeroed, as they were placed."""
        for r, lay in zip(runners, self.kv, strict=True):
            r.kv = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), lay)
        self.kv = None
