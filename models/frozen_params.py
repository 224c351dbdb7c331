"""A read-only view of a parameter pytree (`LLM.params`): reads as the dicts and lists it wraps, raises on item
assignment with a pointer to `LLM.update_params`, and is a pytree, so jax transformations and optax take it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

READ_ONLY = (
    "LLM.params is a read-only view of the weights the engine runs: build a new tree (jax.tree.map over it, or "
    "params.unfreeze() for a copy with plain dicts and lists sharing its arrays) and pass it to LLM.update_params"
)


class FrozenParams(Mapping):
    """A read-only view of a parameter pytree's dicts (`LLM.params`): reads as the dict it wraps (`params["embed"]`,
    `params["layers"][0]["wo"]`, `.get`, `.items()`, `{**params}`), its nested dicts and lists seen as FrozenParams
    and `FrozenLayers`; item assignment raises TypeError pointing to `LLM.update_params`. A pytree of the same
    leaves in the same order as the dict, so `jax.tree.map`, `jax.grad` and optax give FrozenParams back, and
    `update_params` takes them. `unfreeze()`: plain dicts and lists over the same arrays, to edit."""

    __slots__ = ("_tree",)

    def __init__(self, tree: Mapping) -> None:
        object.__setattr__(self, "_tree", dict(tree))

    def __getitem__(self, key):
        return freeze(self._tree[key])

    def __iter__(self) -> Iterator:
        return iter(self._tree)

    def __len__(self) -> int:
        return len(self._tree)

    def __setitem__(self, key, value) -> None:
        raise TypeError(READ_ONLY)

    def __delitem__(self, key) -> None:
        raise TypeError(READ_ONLY)

    def __setattr__(self, name, value) -> None:
        raise TypeError(READ_ONLY)

    def __repr__(self) -> str:
        return f"FrozenParams({list(self._tree)})"

    def unfreeze(self) -> dict:
        """A plain dict (its dicts and lists plain too) holding the same arrays: edit it, then `update_params`."""
        return unfreeze(self)


class FrozenLayers(Sequence):
    """A read-only view of a list in a parameter pytree (the layers): indexing and slicing read it, nested dicts seen
    as `FrozenParams`; item assignment raises TypeError pointing to `LLM.update_params`."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence) -> None:
        object.__setattr__(self, "_items", tuple(items))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FrozenLayers(self._items[i])
        return freeze(self._items[i])

    def __len__(self) -> int:
        return len(self._items)

    def __setitem__(self, i, value) -> None:
        raise TypeError(READ_ONLY)

    def __delitem__(self, i) -> None:
        raise TypeError(READ_ONLY)

    def __setattr__(self, name, value) -> None:
        raise TypeError(READ_ONLY)

    def __repr__(self) -> str:
        return f"FrozenLayers({len(self._items)} items)"

    def unfreeze(self) -> list:
        return unfreeze(self)


def freeze(tree: Any) -> Any:
    """A parameter pytree's dicts and lists (and tuples) as `FrozenParams` / `FrozenLayers`; leaves as they are."""
    if isinstance(tree, (FrozenParams, FrozenLayers)):
        return tree
    if isinstance(tree, Mapping):
        return FrozenParams(tree)
    if isinstance(tree, (list, tuple)):
        return FrozenLayers(tree)
    return tree


def unfreeze(tree: Any) -> Any:
    """A parameter pytree with plain dicts and lists for its mappings and sequences (frozen views, dicts, tuples,
    lists), the arrays and quantized weights shared: the layout `update_params` compares with the engine's."""
    if isinstance(tree, Mapping):
        return {k: unfreeze(tree[k]) for k in tree}
    if isinstance(tree, (FrozenLayers, list, tuple)):
        return [unfreeze(v) for v in tree]
    return tree


def _flatten_params(p: FrozenParams):
    keys = tuple(sorted(p._tree))  # a dict's order, so the leaves line up with the plain pytree's
    return [(jax.tree_util.DictKey(k), p[k]) for k in keys], keys


def _flatten_layers(p: FrozenLayers):
    return [(jax.tree_util.SequenceKey(i), p[i]) for i in range(len(p))], None


jax.tree_util.register_pytree_with_keys(
    FrozenParams, _flatten_params, lambda keys, values: FrozenParams(dict(zip(keys, values, strict=True)))
)
jax.tree_util.register_pytree_with_keys(FrozenLayers, _flatten_layers, lambda _, values: FrozenLayers(values))
