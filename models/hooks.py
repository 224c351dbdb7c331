"""Named hook points inside the forward: user functions that edit or record activations in the jitted step, a head
mask, and the per-token context they see. The hook set is static (one compile per set), its data is traced.

Hook points, per layer i (names "layers.{i}.{point}"):
    resid_pre [T, hidden]          the residual stream entering layer i (layer 0: the input embeddings)
    attn_heads [T, q_heads, head_dim]  each head's attention output, before the output projection (the head mask
                                   multiplies it here)
    attn_out [T, hidden]           the attention block's output (after the output projection and any sandwich norm)
    resid_mid [T, hidden]          the residual stream between the attention and the MLP block
    mlp_out [T, hidden]            the MLP (or mixture-of-experts) block's output
    resid_post [T, hidden]         the residual stream leaving layer i (= resid_pre of layer i + 1)

At a point the head mask (attn_heads only) applies first, then the edit function, then the recording: what is
recorded is what flows on. T counts the step's padded token rows; `HookContext.valid` tells real ones.

Example, a steering vector added to the residual stream after layer 3 (the vector is data, so changing it does not
recompile):

    def steer(x, ctx):  # x: [T, hidden]
        return x + ctx.data.astype(x.dtype)

    hooks = Hooks(edit={"layers.3.resid_post": steer}, data={"layers.3.resid_post": vector})
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

HOOK_POINTS = ("resid_pre", "attn_heads", "attn_out", "resid_mid", "mlp_out", "resid_post")
_NAME = re.compile(r"layers\.(\d+)\.([a-z_]+)")

EditFn = Callable[[jax.Array, "HookContext"], jax.Array]


def hook_name(layer: int, point: str) -> str:
    """The name of hook point `point` of layer `layer`, e.g. hook_name(3, "resid_post") == "layers.3.resid_post"."""
    return f"layers.{layer}.{point}"


def parse_hook_name(name: str, num_layers: int | None = None) -> tuple[int, str]:
    """(layer, point) of a hook name; ValueError naming the valid forms when it is not one (or its layer is out of
    range when `num_layers` is given)."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or m.group(2) not in HOOK_POINTS:
        raise ValueError(f"unknown hook point {name!r}: expected 'layers.<i>.<point>' with point one of {HOOK_POINTS}")
    layer = int(m.group(1))
    if num_layers is not None and layer >= num_layers:
        raise ValueError(f"hook point {name!r}: the model has layers 0..{num_layers - 1}")
    return layer, m.group(2)


@flax.struct.dataclass
class HookContext:
    """What an edit function sees besides the activation: per token row of the step, and the hook's own data."""

    positions: jax.Array  # [T] int32 absolute position of each token in its sequence (0 for padding rows)
    valid: jax.Array  # [T] bool real token (False: padding)
    request: jax.Array  # [T] int32 the token's request: its index among the prompts of the call (-1: padding)
    data: Any = None  # this hook point's entry of `Hooks.data` (any pytree of arrays), or None
    layer: int = flax.struct.field(pytree_node=False, default=-1)


@dataclass(frozen=True)
class LayerHooks:
    """The static hooks of one layer: per point its edit function (or None) and whether it is recorded."""

    layer: int
    edits: tuple[tuple[str, EditFn], ...] = ()
    records: tuple[str, ...] = ()
    head_mask: bool = False

    def edit_fn(self, point: str) -> EditFn | None:
        return dict(self.edits).get(point)


@dataclass(frozen=True)
class HookSpec:
    """The hashable (static) part of a Hooks set: which points are edited (by which function), recorded, and which
    layers have a head mask. Two sets with the same spec share compiled programs."""

    layers: tuple[LayerHooks, ...]

    def for_layer(self, i: int) -> LayerHooks | None:
        return next((lh for lh in self.layers if lh.layer == i), None)


@dataclass(frozen=True)
class Hooks:
    """A set of interventions on the forward: `edit` maps hook names to functions `fn(x, ctx) -> x` (same shape and
    dtype; `ctx` is a HookContext), `record` lists hook names whose activations are returned, `head_mask` maps a
    layer to per-head multipliers [q_heads] (0 ablates a head), `data` maps hook names to arrays (any pytree) that
    reach the edit function as `ctx.data`. Functions and names make the static spec (compiled once per spec);
    data and head masks are traced arguments, so new values reuse the compiled step."""

    edit: Mapping[str, EditFn] = field(default_factory=dict)
    record: Iterable[str] = ()
    head_mask: Mapping[int, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "edit", dict(self.edit))
        object.__setattr__(
            self, "record", tuple(dict.fromkeys([self.record] if isinstance(self.record, str) else self.record))
        )
        object.__setattr__(self, "head_mask", {int(k): v for k, v in dict(self.head_mask).items()})
        object.__setattr__(self, "data", dict(self.data))
        for name, fn in self.edit.items():
            parse_hook_name(name)
            if not callable(fn):
                raise ValueError(f"hook {name!r}: the edit must be a function fn(x, ctx) -> x, got {fn!r}")
        for name in (*self.record, *self.data):
            parse_hook_name(name)
        for name in self.data:
            if name not in self.edit:
                raise ValueError(f"hook data for {name!r} has no edit function to receive it")

    def check(self, num_layers: int, num_heads: int) -> None:
        """ValueError when a name's layer is out of range or a head mask is not [num_heads]."""
        for name in (*self.edit, *self.record):
            parse_hook_name(name, num_layers)
        for layer, mask in self.head_mask.items():
            if not 0 <= layer < num_layers:
                raise ValueError(f"head mask for layer {layer}: the model has layers 0..{num_layers - 1}")
            if jnp.shape(mask) != (num_heads,):
                raise ValueError(f"head mask for layer {layer} must have shape ({num_heads},), got {jnp.shape(mask)}")

    @property
    def spec(self) -> HookSpec:
        layers: dict[int, dict] = {}

        def of(i):
            return layers.setdefault(i, {"edits": [], "records": [], "head_mask": False})

        for name, fn in self.edit.items():
            i, point = parse_hook_name(name)
            of(i)["edits"].append((point, fn))
        for name in self.record:
            i, point = parse_hook_name(name)
            of(i)["records"].append(point)
        for i in self.head_mask:
            of(i)["head_mask"] = True
        return HookSpec(
            tuple(
                LayerHooks(i, tuple(v["edits"]), tuple(v["records"]), v["head_mask"]) for i, v in sorted(layers.items())
            )
        )

    @property
    def arrays(self) -> dict[str, Any]:
        """The traced inputs: {"data": {name: pytree}, "head_mask": {layer: [q_heads] float32}}, keys as strings."""
        return {
            "data": dict(self.data),
            "head_mask": {str(i): jnp.asarray(m, jnp.float32) for i, m in self.head_mask.items()},
        }


def layer_inputs(arrays: dict[str, Any] | None, lh: LayerHooks | None) -> dict[str, Any] | None:
    """The part of `Hooks.arrays` layer `lh` reads: {"data": {point: pytree}, "head_mask": [q_heads] or None}."""
    if lh is None or arrays is None:
        return None
    data = {p: arrays["data"][hook_name(lh.layer, p)] for p, _ in lh.edits if hook_name(lh.layer, p) in arrays["data"]}
    return {"data": data, "head_mask": arrays["head_mask"].get(str(lh.layer)) if lh.head_mask else None}


def apply_point(
    x: jax.Array,
    point: str,
    lh: LayerHooks | None,
    ctx: HookContext | None,
    inputs: dict[str, Any] | None,
    records: dict[str, jax.Array],
) -> jax.Array:
    """Run hook point `point` of a layer on x: head mask (attn_heads), edit function, then recording into
    `records` (keyed by the full hook name). A no-op without hooks for this layer."""
    if lh is None:
        return x
    if point == "attn_heads" and lh.head_mask:
        x = x * inputs["head_mask"].astype(x.dtype)[None, :, None]
    fn = lh.edit_fn(point)
    if fn is not None:
        y = fn(x, ctx.replace(data=inputs["data"].get(point), layer=lh.layer))
        name = hook_name(lh.layer, point)
        if not hasattr(y, "shape") or y.shape != x.shape:
            raise ValueError(f"hook {name!r} returned shape {getattr(y, 'shape', None)}, expected {x.shape}")
        x = y.astype(x.dtype)
    if point in lh.records:
        records[hook_name(lh.layer, point)] = x
    return x
