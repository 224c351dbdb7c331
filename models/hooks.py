"""Named hook points inside the forward: user functions that edit or record activations in the jitted step, a head
mask, and the per-token context they see. Hook sets are static (one compile per set's code), their data is traced.

Hook points, per layer i (names "layers.{i}.{point}"; T token rows, K keys):
    resid_pre [T, hidden]              the residual stream entering layer i (layer 0: the input embeddings)
    q [T, q_heads, head_dim]           the query projection's output (bias and LoRA included), before q-norm and RoPE
    k, v [T, kv_heads, head_dim]       the key and value projections' outputs, likewise
    q_rot [T, q_heads, head_dim]       the queries attention reads: after q-norm (Qwen3, Gemma 3) and RoPE
    k_rot [T, kv_heads, head_dim]      the keys written to the cache: after k-norm and RoPE
    pattern [T, q_heads, K] float32    post-softmax attention probabilities; key j is position j of the token's
                                       sequence (zero outside the causal and sliding window; an attention sink's mass
                                       is not a column). Computed only at layers whose pattern is hooked; an edit
                                       replaces the attention output of the edited rows by pattern @ V
    attn_heads [T, q_heads, head_dim]  each head's attention output, before the output projection (the head mask
                                       multiplies it here)
    attn_out [T, hidden]               the attention block's output (after the output projection and any sandwich norm)
    resid_mid [T, hidden]              the residual stream between the attention and the MLP block
    mlp_pre [T, intermediate]          the gate projection's output, before the activation (dense MLP layers)
    mlp_post [T, intermediate]         the MLP's neurons: act(gate) * up, the down projection's input (dense MLP layers)
    mlp_out [T, hidden]                the MLP (or mixture-of-experts) block's output
    resid_post [T, hidden]             the residual stream leaving layer i (= resid_pre of layer i + 1)
and of the whole model: final_norm [T, hidden] (the final norm's output) and logits [T, vocab] float32.

At a point the head mask (attn_heads only) applies first, then the edit function, then the recording: what is
recorded is what flows on. T counts the step's padded token rows; `HookContext.valid` tells real ones, and an edit
only ever changes the rows of its own requests (the others keep their values, whatever the function returns there).

Several hook sets run in one step (the engine batches requests with different hooks and none): each token row
belongs to one set or none (`group`), and a set's functions see every row but change only their own.

A function is keyed by its code and what it captures, not by its identity: a new lambda with the same code whose
closure holds arrays of the same shapes (lifted into traced arguments) and equal hashable values reuses the compiled
step. Closures holding anything else (a list, a dict) fall back to identity, with a warning saying how to avoid it.

Example, a steering vector added to the residual stream after layer 3 (the vector is data, so changing it does not
recompile):

    def steer(x, ctx):  # x: [T, hidden]
        return x + ctx.data.astype(x.dtype)

    hooks = Hooks(edit={"layers.3.resid_post": steer}, data={"layers.3.resid_post": vector})
"""

from __future__ import annotations

import re
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops.attention.metadata import AttentionMetadata
from netra_jax.ops.attention.pattern import attend_probs, attention_probs

if TYPE_CHECKING:
    from netra_jax.config import ModelConfig

LAYER_POINTS = (
    "resid_pre",
    "q",
    "k",
    "v",
    "q_rot",
    "k_rot",
    "pattern",
    "attn_heads",
    "attn_out",
    "resid_mid",
    "mlp_pre",
    "mlp_post",
    "mlp_out",
    "resid_post",
)
MODEL_POINTS = ("final_norm", "logits")
DENSE_MLP_POINTS = ("mlp_pre", "mlp_post")  # not in mixture-of-experts layers
MODEL_LAYER = -1  # the `layer` of the model-level points in a hook spec
_NAME = re.compile(r"layers\.(\d+)\.([a-z_]+)")

EditFn = Callable[[jax.Array, "HookContext"], jax.Array]


def hook_name(layer: int | None, point: str) -> str:
    """The name of hook point `point` of layer `layer` (None or MODEL_LAYER: a model-level point), e.g.
    hook_name(3, "resid_post") == "layers.3.resid_post", hook_name(None, "logits") == "logits"."""
    return point if layer is None or layer == MODEL_LAYER else f"layers.{layer}.{point}"


def parse_hook_name(name: str, num_layers: int | None = None) -> tuple[int, str]:
    """(layer, point) of a hook name (layer MODEL_LAYER for "final_norm" and "logits"); ValueError naming the valid
    forms when it is not one (or its layer is out of range when `num_layers` is given)."""
    if name in MODEL_POINTS:
        return MODEL_LAYER, name
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or m.group(2) not in LAYER_POINTS:
        raise ValueError(
            f"unknown hook point {name!r}: expected 'layers.<i>.<point>' with point one of {LAYER_POINTS}, "
            f"or one of {MODEL_POINTS}"
        )
    layer = int(m.group(1))
    if num_layers is not None and layer >= num_layers:
        raise ValueError(f"hook point {name!r}: the model has layers 0..{num_layers - 1}")
    return layer, m.group(2)


def hook_points(cfg: ModelConfig) -> dict[str, tuple]:
    """Every hook point of a model with its shape: {name: shape}, "T" for the token rows and "K" for the keys
    (a prompt's length in `LLM.run_with_hooks` and `run_with_cache`), in the order the forward reaches them."""
    H, KH, D, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    shapes = {
        "resid_pre": ("T", hidden),
        "q": ("T", H, D),
        "k": ("T", KH, D),
        "v": ("T", KH, D),
        "q_rot": ("T", H, D),
        "k_rot": ("T", KH, D),
        "pattern": ("T", H, "K"),
        "attn_heads": ("T", H, D),
        "attn_out": ("T", hidden),
        "resid_mid": ("T", hidden),
        "mlp_pre": ("T", cfg.intermediate_size),
        "mlp_post": ("T", cfg.intermediate_size),
        "mlp_out": ("T", hidden),
        "resid_post": ("T", hidden),
    }
    out = {}
    for i in range(cfg.num_layers):
        for p in LAYER_POINTS:
            if p in DENSE_MLP_POINTS and cfg.is_moe_layer(i):
                continue
            out[hook_name(i, p)] = shapes[p]
    out["final_norm"] = ("T", hidden)
    out["logits"] = ("T", cfg.vocab_size)
    return out


# ---------------------------------------------------------------------------------------------- function keys
_ARRAY_TYPES = (jax.Array, np.ndarray)


class _Unkeyable(Exception):
    """A captured value that neither lifts to a traced argument nor hashes."""


def _cell_key(value: Any, arrays: list) -> tuple:
    """The static key of one captured value; arrays are appended to `arrays` (traced) and keyed by shape and dtype."""
    if isinstance(value, _ARRAY_TYPES):  # (a tracer of an enclosing transformation too)
        arrays.append(value)
        return ("array", tuple(value.shape), str(value.dtype))
    if isinstance(value, types.FunctionType):
        nested: list = []
        key = _function_key(value, nested)
        if nested:  # a nested function capturing arrays: keep it simple, key it by identity
            raise _Unkeyable(f"a function capturing arrays ({value.__qualname__})")
        return ("fn", key)
    try:
        hash(value)
    except TypeError:
        raise _Unkeyable(type(value).__name__) from None
    return ("value", type(value), value)


def _function_key(fn: types.FunctionType, arrays: list) -> tuple:
    cells = tuple(_cell_key(c.cell_contents, arrays) for c in fn.__closure__ or ())
    defaults = tuple(_cell_key(d, []) for d in fn.__defaults__ or ())
    kwdefaults = tuple(sorted((k, _cell_key(v, [])) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("code", fn.__code__, id(fn.__globals__), defaults, kwdefaults, cells)


_warned: set = set()


class StaticFn:
    """An edit function as a hook spec holds it: hashed and compared by its code and captured values, with the
    arrays it captures lifted out (`arrays`, passed to the step as traced arguments and put back in `__call__`), so
    that a new function object computing the same thing reuses the compiled step."""

    def __init__(self, fn: EditFn) -> None:
        self.fn = fn
        arrays: list = []
        try:
            if not isinstance(fn, types.FunctionType):
                raise _Unkeyable(type(fn).__name__)
            self.key = _function_key(fn, arrays)
            self.arrays = tuple(arrays)
        except (_Unkeyable, ValueError) as e:  # ValueError: an empty closure cell
            self.key, self.arrays = ("id", id(fn)), ()
            where = getattr(fn, "__qualname__", type(fn).__name__)
            if where not in _warned:
                _warned.add(where)
                warnings.warn(
                    f"hook function {where} is keyed by identity (it captures {e}): each new function object "
                    "compiles the step again; reuse one function, or pass changing values through Hooks.data",
                    stacklevel=4,
                )

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticFn) and self.key == other.key

    def __call__(self, x: jax.Array, ctx: HookContext, arrays: tuple = ()) -> jax.Array:
        fn = self.fn
        if arrays:  # the same code over the traced stand-ins of the captured arrays
            it = iter(arrays)
            cells = tuple(
                types.CellType(next(it)) if isinstance(c.cell_contents, _ARRAY_TYPES) else c for c in fn.__closure__
            )
            fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
            fn.__kwdefaults__ = self.fn.__kwdefaults__
        return fn(x, ctx)

    def __repr__(self) -> str:
        return f"StaticFn({getattr(self.fn, '__qualname__', self.fn)!r})"


# ---------------------------------------------------------------------------------------------- specs
@flax.struct.dataclass
class HookContext:
    """What an edit function sees besides the activation: per token row of the step, and the hook's own data."""

    positions: jax.Array  # [T] int32 absolute position of each token in its sequence (0 for padding rows)
    valid: jax.Array  # [T] bool a real token of this hook set's requests (False: padding, or another set's)
    request: jax.Array  # [T] int32 the token's request: its index among the prompts of the call (-1: padding)
    data: Any = None  # this hook point's entry of `Hooks.data` (any pytree of arrays), or None
    group: jax.Array | None = None  # [T] int32 the hook set each row belongs to in the step (-1: none)
    layer: int = flax.struct.field(pytree_node=False, default=-1)


@dataclass(frozen=True)
class LayerHooks:
    """The static hooks of one hook set at one layer (MODEL_LAYER: the model-level points): per point its edit
    function (or None), the points recorded, and whether a head mask applies."""

    layer: int
    edits: tuple[tuple[str, StaticFn], ...] = ()
    records: tuple[str, ...] = ()
    head_mask: bool = False

    def edit_fn(self, point: str) -> StaticFn | None:
        return dict(self.edits).get(point)

    def touches(self, point: str) -> bool:
        return point in self.records or self.edit_fn(point) is not None


@dataclass(frozen=True)
class HookSpec:
    """The hashable (static) part of one Hooks set: which points are edited (by which function), recorded, and which
    layers have a head mask. Two sets with the same spec share compiled programs."""

    layers: tuple[LayerHooks, ...]

    def for_layer(self, i: int) -> LayerHooks | None:
        return next((lh for lh in self.layers if lh.layer == i), None)

    @property
    def records(self) -> tuple[str, ...]:
        return tuple(hook_name(lh.layer, p) for lh in self.layers for p in lh.records)


@dataclass(frozen=True)
class LayerGroups:
    """The hooks of every set of a step at one layer: (set index, its LayerHooks) pairs."""

    layer: int
    groups: tuple[tuple[int, LayerHooks], ...]

    def touches(self, point: str) -> bool:
        return any(lh.touches(point) for _, lh in self.groups)

    def edits(self, point: str) -> bool:
        return any(lh.edit_fn(point) is not None for _, lh in self.groups)


@dataclass(frozen=True)
class StepHooks:
    """The static hooks of one step: the specs of the hook sets its rows belong to (row group g runs `sets[g]`),
    and, when a pattern is hooked, how many keys it spans (None: the block table's width)."""

    sets: tuple[HookSpec, ...]
    pattern_keys: int | None = None

    def at(self, layer: int) -> LayerGroups | None:
        groups = tuple((g, lh) for g, s in enumerate(self.sets) if (lh := s.for_layer(layer)) is not None)
        return LayerGroups(layer, groups) if groups else None

    @property
    def wants_pattern(self) -> bool:
        return any(lh.touches("pattern") for s in self.sets for lh in s.layers)


@dataclass(frozen=True)
class Hooks:
    """A set of interventions on the forward: `edit` maps hook names to functions `fn(x, ctx) -> x` (same shape and
    dtype; `ctx` is a HookContext), `record` lists hook names whose activations are returned, `head_mask` maps a
    layer to per-head multipliers [q_heads] (0 ablates a head), `data` maps hook names to arrays (any pytree) that
    reach the edit function as `ctx.data`. Functions (by code) and names make the static spec (compiled once per
    spec); data, head masks and arrays a function captures are traced arguments, so new values reuse the step."""

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
        # keyed once per set: the spec and the lifted arrays read the same StaticFn objects
        object.__setattr__(self, "_static", {name: StaticFn(fn) for name, fn in self.edit.items()})

    def check(self, cfg: ModelConfig) -> None:
        """ValueError when a name's layer is out of range, a dense-MLP point names a mixture-of-experts layer, or a
        head mask is not [q_heads]."""
        for name in (*self.edit, *self.record):
            layer, point = parse_hook_name(name, cfg.num_layers)
            if point in DENSE_MLP_POINTS and cfg.is_moe_layer(layer):
                raise ValueError(f"hook point {name!r}: layer {layer} is a mixture-of-experts layer (no {point})")
        for layer, mask in self.head_mask.items():
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"head mask for layer {layer}: the model has layers 0..{cfg.num_layers - 1}")
            if jnp.shape(mask) != (cfg.num_heads,):
                raise ValueError(
                    f"head mask for layer {layer} must have shape ({cfg.num_heads},), got {jnp.shape(mask)}"
                )

    @property
    def spec(self) -> HookSpec:
        layers: dict[int, dict] = {}

        def of(i):
            return layers.setdefault(i, {"edits": [], "records": [], "head_mask": False})

        for name in self.edit:
            i, point = parse_hook_name(name)
            of(i)["edits"].append((point, self._static[name]))
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
        """The traced inputs: {"data": {name: pytree}, "head_mask": {layer: [q_heads] float32}, "captured": {name:
        arrays the edit function captures}}, keys as strings."""
        return {
            "data": dict(self.data),
            "head_mask": {str(i): jnp.asarray(m, jnp.float32) for i, m in self.head_mask.items()},
            "captured": {name: s.arrays for name, s in self._static.items() if s.arrays},
        }


def step_hooks(hooks: Hooks | HookSpec | StepHooks, arrays=None) -> tuple[StepHooks, tuple]:
    """A step's static hooks and their arrays (one entry per set) from one Hooks set, one spec with its arrays, or
    a StepHooks with its tuple of arrays."""
    if isinstance(hooks, Hooks):
        return StepHooks((hooks.spec,)), (hooks.arrays,)
    if isinstance(hooks, HookSpec):
        return StepHooks((hooks,)), (arrays,)
    return hooks, tuple(arrays)


def layer_inputs(arrays: tuple | None, lg: LayerGroups | None) -> dict[int, Any] | None:
    """What layer `lg` reads of each set's arrays: {set: {"data": {point: pytree}, "head_mask": [q_heads] or None,
    "captured": {point: arrays}}}."""
    if lg is None or arrays is None:
        return None
    out = {}
    for g, lh in lg.groups:
        a = arrays[g]
        names = {p: hook_name(lh.layer, p) for p, _ in lh.edits}
        out[g] = {
            "data": {p: a["data"][n] for p, n in names.items() if n in a["data"]},
            "captured": {p: a["captured"][n] for p, n in names.items() if n in a.get("captured", {})},
            "head_mask": a["head_mask"].get(str(lh.layer)) if lh.head_mask else None,
        }
    return out


def _rows(sel: jax.Array, x: jax.Array) -> jax.Array:
    return sel.reshape(sel.shape + (1,) * (x.ndim - 1))  # [T, 1, ...] to select whole rows of x


def apply_point(
    x: jax.Array,
    point: str,
    lg: LayerGroups | None,
    ctx: HookContext | None,
    inputs: dict[int, Any] | None,
    records: dict[str, jax.Array],
) -> jax.Array:
    """Run hook point `point` of a layer on x [T, ...]: for each hook set, on its rows only, the head mask
    (attn_heads), then its edit function; then the recording into `records` (keyed by the full hook name). A no-op
    without hooks for this layer."""
    if lg is None:
        return x
    for g, lh in lg.groups:
        sel = ctx.group == g  # [T] this set's rows
        if point == "attn_heads" and lh.head_mask:
            mask = inputs[g]["head_mask"].astype(x.dtype)[None, :, None]  # [1, q_heads, 1]
            x = jnp.where(_rows(sel, x), x * mask, x)
        fn = lh.edit_fn(point)
        if fn is not None:
            name = hook_name(lh.layer, point)
            own = ctx.replace(valid=ctx.valid & sel, data=inputs[g]["data"].get(point), layer=lh.layer)
            y = fn(x, own, inputs[g]["captured"].get(point, ()))
            if not hasattr(y, "shape") or y.shape != x.shape:
                raise ValueError(f"hook {name!r} returned shape {getattr(y, 'shape', None)}, expected {x.shape}")
            x = jnp.where(_rows(sel, x), y.astype(x.dtype), x)
    if any(point in lh.records for _, lh in lg.groups):
        records[hook_name(lg.layer, point)] = x
    return x


def hook_context(md: AttentionMetadata, positions: jax.Array, request=None, group=None) -> HookContext:
    """The per-row context of a step's hooks: positions [T], request [T] each row's request index (default 0) and
    group [T] its hook set (default 0); both -1 on padding rows (`md.layout.valid` False)."""
    valid = md.layout.valid  # [T]
    request = jnp.where(valid, 0, -1) if request is None else request  # [T] int32
    group = jnp.where(valid, 0, -1) if group is None else group  # [T] int32
    return HookContext(positions=positions, valid=valid, request=request, group=group)


def pattern_point(o, q, kp, vp, md: AttentionMetadata, sinks, masking: dict, lg: LayerGroups, ctx, num_keys, point):
    """The `pattern` hook point of a layer: the probabilities of queries q [T, q_heads, head_dim] over the keys in
    kp (`netra_jax.ops.attention.pattern`, with the layer's `masking`: scale, sliding window, soft-cap), through
    `point`; rows of a hook set that edits the pattern take attention recomputed from the edited probabilities
    instead of the kernel's output o [T, q_heads, head_dim]."""
    probs = attention_probs(q, kp, md, **masking, sinks=sinks, num_keys=num_keys)  # [T, q_heads, K]
    probs = point("pattern", probs)
    editing = [g for g, lh in lg.groups if lh.edit_fn("pattern") is not None]
    if not editing:
        return o
    edited = jnp.isin(ctx.group, jnp.asarray(editing, jnp.int32))[:, None, None]  # [T, 1, 1]
    return jnp.where(edited, attend_probs(probs, vp, md).astype(o.dtype), o)


def patch(x: jax.Array, ctx: HookContext) -> jax.Array:
    """An edit that writes cached activations (activation patching): ctx.data = {"values": [P, ...] the
    activation to write at each position p (from another prompt or run), or [R, P, ...] one per request,
    "mask": [P] or [R, P] bool whether position p (of request r = `HookContext.request`) is patched}; rows at
    positions >= P, or not selected, keep x. One function for every point and layer, so a sweep compiles once.

        Hooks(edit={name: patch}, data={name: {"values": clean[name], "mask": mask}})
    """
    values, mask = ctx.data["values"], ctx.data["mask"]
    P = mask.shape[-1]
    pos = jnp.clip(ctx.positions, 0, P - 1)  # [T]
    req = jnp.clip(ctx.request, 0, None)  # [T]
    sel = mask[jnp.minimum(req, mask.shape[0] - 1), pos] if mask.ndim == 2 else mask[pos]  # [T]
    v = values[jnp.minimum(req, values.shape[0] - 1), pos] if values.ndim == x.ndim + 1 else values[pos]  # [T, ...]
    sel = sel & ctx.valid & (ctx.positions < P)
    return jnp.where(sel.reshape(sel.shape + (1,) * (x.ndim - 1)), v.astype(x.dtype), x)
