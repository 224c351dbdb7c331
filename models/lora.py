"""LoRA adapters over the pure forward: PEFT checkpoints read into per-layer low-rank factors (checked against the
base model), a fixed number of device slots that hold several adapters at once, and the per-token delta.

An adapter adds `scale * (x @ A) @ B` to a projection's output, scale = alpha / r (alpha / sqrt(r) with rsLoRA);
here the scale is folded into B at load. Targets, by their names in the PEFT checkpoint: q_proj, k_proj, v_proj,
o_proj (attention) and gate_proj, up_proj, down_proj (dense MLP layers). An adapter keeps one factor pair per
projection; the slots join the projections that share an input, their deltas side by side as our fused weights'
outputs are (wqkv, w_gate_up), each added to the part its projection owns.

Slots (what the forward takes): per layer, one pair of factors per group of projections sharing an input (q/k/v,
o, gate/up, down) holding all S slots side by side, rank R each (the largest rank served; smaller adapters are
zero-padded, which adds exact zeros), and `slots` [T] int32, each token's slot, -1 for the base model. A group's
delta is two plain matmuls for every slot and target at once (see `lora_delta`). Every target of every layer is
always present (zeros where an adapter leaves it), so the compiled step never depends on which adapters, ranks or
mixes a batch holds.

Training: `adapter_slots` builds one adapter's slot with jnp pad/concatenate (the layout `set_slot` writes), so
`jax.grad` of a loss of `forward_dense(..., lora=adapter_slots(...), lora_slot=0)` reaches each factor of the
adapter's weights; `init_adapter` starts a trainable adapter as PEFT does (A random, B zeros) and `save_peft_adapter`
writes one as a PEFT directory (PEFT's file layout and tensor names) that `load_peft_adapter` reads back.

Tensor parallelism (`slot_specs`): the factors split as the weights they modify. Column-parallel groups (q/k/v,
gate/up): A replicated, B split on its outputs, its columns stored device-major (device d's q, k and v columns, or
gate and up, side by side: `set_slot(..., tp=)`), so each device's share of B is the slice it needs and
`from_device_major` puts the delta back in the fused order without moving data; row-parallel groups (o, down): A
split on its inputs as the weight's rows are (XLA sums the [T, S*Rg] partial shrinks), B replicated."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from netra_jax.config import ModelConfig
from netra_jax.models.weight_map import TP
from netra_jax.ops.lora_segment import lora_segment_delta
from netra_jax.quant import GPU_BACKENDS

__all__ = [
    "GROUPS",
    "TARGETS",
    "LoRAAdapter",
    "LoRAError",
    "LayerLoRA",
    "adapter_slots",
    "empty_slots",
    "init_adapter",
    "load_peft_adapter",
    "from_device_major",
    "lora_delta",
    "slot_specs",
    "save_peft_adapter",
    "set_slot",
    "slot_blocks",
    "target_shapes",
    "write_slot",
]

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_PEFT_MODULES = {f"{t}_proj": t for t in TARGETS}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (Gemma 3's multimodal checkpoints add
# language_model.; PEFT's adapter name may stand before .weight in checkpoints saved without stripping it)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
    r"(self_attn|mlp)\.([A-Za-z0-9_.]+?)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)

# the projections that share an input, in the order of the fused weights' outputs (wqkv, w_gate_up)
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
# one layer's slots: group -> (a [in, S, Rg], b [S, Rg, out]); see `empty_slots`
LayerLoRA = dict[str, tuple[jax.Array, jax.Array]]


class LoRAError(ValueError):
    """An adapter that cannot be served on this model; the message names the file, tensor or setting."""


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter's factors, ready for a slot: weights[(layer, target)] = (a [in, r] float32, b [r, out] float32,
    the scale folded in), numpy arrays as `load_peft_adapter` reads them or jax arrays (`init_adapter`, or trained:
    the weights dict is a pytree, what `jax.grad` and optax take). `rank` is the largest r of its modules."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray | jax.Array, np.ndarray | jax.Array]]

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.weights}, key=TARGETS.index)


def target_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection an adapter may target in `layer` (MLP targets only in dense MLP layers)."""
    shapes = {
        "q": (cfg.hidden_size, cfg.q_size),
        "k": (cfg.hidden_size, cfg.kv_size),
        "v": (cfg.hidden_size, cfg.kv_size),
        "o": (cfg.q_size, cfg.hidden_size),
    }
    if not cfg.is_moe_layer(layer):
        shapes |= {
            "gate": (cfg.hidden_size, cfg.intermediate_size),
            "up": (cfg.hidden_size, cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size),
        }
    return shapes


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that the module's name ends with (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"{path}: no adapter_config.json (a PEFT LoRA adapter directory holds it)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(f"{cfg_file}: not JSON ({e})") from None
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA is served)"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} (fully trained modules)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (config.get("lora_bias"), "lora_bias (a bias on lora_B)"),
        (config.get("use_dora"), "use_dora (DoRA's magnitude vectors)"),
        (config.get("target_parameters"), "target_parameters (LoRA on MoE expert weights)"),
        (config.get("layer_replication"), "layer_replication"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoRAError(f"{cfg_file}: {what} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise LoRAError(f"{cfg_file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def load_peft_adapter(
    path: str | Path, cfg: ModelConfig, *, name: str | None = None, max_rank: int | None = None
) -> LoRAAdapter:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) for the model `cfg`.

    Raises LoRAError naming the problem: a refused setting (modules_to_save, a bias, DoRA, expert weights), a tensor
    that targets something other than the q/k/v/o and dense gate/up/down projections, a layer the model lacks, a
    shape that does not match the base projection, A without B, or a rank over `max_rank`."""
    from safetensors.numpy import load_file

    path = Path(path)
    config = _read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (adapter_model.bin, a pickle, is not read: convert it to safetensors)"
        raise LoRAError(
            f"{path}: no adapter_model.safetensors" + (hint if (path / "adapter_model.bin").exists() else "")
        )
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise LoRAError(f"{weights_file}: not a safetensors file ({e})") from None
    factors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{weights_file}: tensor {key!r} is not a LoRA factor of a decoder layer's projection")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        target = _PEFT_MODULES.get(module)
        if target is None or (block == "self_attn") != (target in ATTENTION_TARGETS):
            what = "expert weights" if "experts" in module else f"module {block}.{module}"
            raise LoRAError(
                f"{weights_file}: tensor {key!r} targets {what}; served targets are "
                f"{', '.join(_PEFT_MODULES)} (MLP ones in dense layers)"
            )
        if layer >= cfg.num_layers:
            raise LoRAError(f"{weights_file}: tensor {key!r} is for layer {layer}; the model has {cfg.num_layers}")
        shapes = target_shapes(cfg, layer)
        if target not in shapes:
            raise LoRAError(f"{weights_file}: tensor {key!r} targets layer {layer}'s MLP, a mixture of experts")
        factors.setdefault((layer, target), {})[which] = np.asarray(value, np.float32)
        modules[(layer, target)] = _module_name(layer, target)  # block and module agree with target (checked)
    if not factors:
        raise LoRAError(f"{weights_file}: no LoRA factors")
    weights, rank = {}, 0
    for (layer, target), ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{weights_file}: {modules[(layer, target)]} has no {missing}")
        a, b = ab["A"], ab["B"]  # PEFT: lora_A.weight [r, in], lora_B.weight [out, r]
        fan_in, fan_out = target_shapes(cfg, layer)[target]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoRAError(
                f"{weights_file}: {modules[(layer, target)]}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do "
                f"not fit the projection [{fan_in} -> {fan_out}] (expected [r, {fan_in}] and [{fan_out}, r])"
            )
        if max_rank is not None and r > max_rank:
            raise LoRAError(f"{weights_file}: {modules[(layer, target)]} has rank {r}, over max_lora_rank={max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), modules[(layer, target)], config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[(layer, target)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * np.float32(scale))
        rank = max(rank, r)
    return LoRAAdapter(name=name or path.name, rank=rank, weights=weights)


def _module_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}_proj"


def save_peft_adapter(
    adapter: LoRAAdapter, path: str | Path, *, base_model_name_or_path: str | None = None, alpha: float | None = None
) -> Path:
    """Write `adapter` as a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors, float32 factors named
    base_model.model.model.layers.{i}.{self_attn|mlp}.{target}_proj.lora_{A,B}.weight, A [r, in], B [out, r], as PEFT
    saves them) that `load_peft_adapter` reads back to the same factors. Returns the directory.

    The folded scale is undone with the alpha written: by default lora_alpha = r (scale 1, B written as held); with
    `alpha`, scale = alpha / r and B is written divided by it. Modules of a rank other than the largest get PEFT's
    rank_pattern (and, without `alpha`, alpha_pattern) entries."""
    from safetensors.numpy import save_file

    if not adapter.weights:
        raise LoRAError(f"adapter {adapter.name!r} has no factors to save")
    if alpha is not None and not alpha > 0:
        raise LoRAError(f"alpha must be a positive number, got {alpha!r}")
    ranks = {key: np.shape(a)[1] for key, (a, _) in adapter.weights.items()}
    rank = max(ranks.values())
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        module, r = _module_name(layer, target), ranks[(layer, target)]
        if r != rank:
            rank_pattern[module] = r
            if alpha is None:
                alpha_pattern[module] = r
        scale = 1.0 if alpha is None else alpha / r
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(
            (np.asarray(b, np.float32) / np.float32(scale)).T
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "target_modules": sorted({f"{t}_proj" for _, t in adapter.weights}),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    return path


def init_adapter(
    cfg: ModelConfig, key: jax.Array, rank: int, *, targets: tuple[str, ...] = TARGETS, name: str = "lora"
) -> LoRAAdapter:
    """A trainable adapter of rank `rank` on `targets` of every layer (MLP ones in dense layers), initialised as PEFT's
    default (init_lora_weights=True): A kaiming-uniform (torch's kaiming_uniform_(a=sqrt(5)) on lora_A [r, in], i.e.
    uniform in +-1/sqrt(in)), B zeros, so the adapter starts as the base model. The weights are float32 jax arrays.

    There is no alpha here: the scale is folded into b, which starts at zero (with Adam, a scale on b only rescales
    its step size); `save_peft_adapter` writes the alpha. Train `adapter.weights` (a pytree) and rebuild the adapter
    with `dataclasses.replace(adapter, weights=trained)`."""
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"rank must be a positive integer, got {rank!r}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise LoRAError(f"targets {list(targets)}: each must be one of {', '.join(TARGETS)}")
    shapes = [
        ((i, t), target_shapes(cfg, i)[t])
        for i in range(cfg.num_layers)
        for t in TARGETS
        if t in targets and t in target_shapes(cfg, i)
    ]
    if not shapes:
        raise LoRAError(f"targets {list(targets)}: none is in this model (MLP targets need dense MLP layers)")
    keys = jax.random.split(key, len(shapes))
    weights = {}
    for k, (where, (fan_in, fan_out)) in zip(keys, shapes, strict=True):
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(k, (fan_in, rank), jnp.float32, -bound, bound)
        weights[where] = (a, jnp.zeros((rank, fan_out), jnp.float32))
    return LoRAAdapter(name=name, rank=rank, weights=weights)


def _group_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """group -> (its input width, [(target, output width)] in the fused output's order), for this layer."""
    shapes = target_shapes(cfg, layer)
    return {
        g: (shapes[ts[0]][0], [(t, shapes[t][1]) for t in ts])
        for g, ts in GROUPS.items()
        if all(t in shapes for t in ts)
    }


def empty_slots(cfg: ModelConfig, num_slots: int, max_rank: int, dtype=jnp.float32) -> list[LayerLoRA]:
    """Zeroed slots for every group of every layer: per layer {group: (a [in, S, Rg], b [S, Rg, out])}, Rg = max_rank
    times the group's targets; target j of the group owns the j-th max_rank of a slot's Rg and writes only its own
    output columns of b."""
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for g, (fan_in, outs) in _group_shapes(cfg, i).items():
            group_rank, fan_out = max_rank * len(outs), sum(n for _, n in outs)
            layer[g] = (
                jnp.zeros((fan_in, num_slots, group_rank), dtype),
                jnp.zeros((num_slots, group_rank, fan_out), dtype),
            )
        layers.append(layer)
    return layers


COLUMN_PARALLEL = ("qkv", "gate_up")  # groups whose outputs split over tensor-parallel devices (the others: inputs)


def _device_major(widths: list[int], tp: int) -> np.ndarray:
    """The column order of a fused output of targets `widths` (each divisible by tp) stored device-major: [out]
    indices, device d's share of each target in turn."""
    offsets = np.cumsum([0, *widths[:-1]])
    return np.concatenate(
        [o + d * (w // tp) + np.arange(w // tp) for d in range(tp) for o, w in zip(offsets, widths, strict=True)]
    )


def from_device_major(delta: jax.Array, widths: list[int], tp: int) -> jax.Array:
    """A column-parallel group's delta [T, out] computed with device-major B (`set_slot(..., tp=tp)`) back in the
    fused order (targets side by side); with the columns split over tp devices, each keeps its own (no data moves)."""
    if tp == 1:
        return delta
    T = delta.shape[0]
    per_device = delta.reshape(T, tp, -1)  # [T, tp, out / tp]: device d's share of every target
    parts = jnp.split(per_device, np.cumsum([w // tp for w in widths[:-1]]), axis=2)
    return jnp.concatenate([p.reshape(T, -1) for p in parts], axis=1)  # [T, out]


def slot_specs(slots: list[LayerLoRA]) -> list[dict[str, tuple[P, P]]]:
    """The PartitionSpecs of slots (per layer {group: (a [in, S, Rg], b [S, Rg, out])}) over the "tp" mesh axis, as
    the weights they modify split: column-parallel groups' B on outputs, row-parallel groups' A on inputs."""
    col, row = (P(), P(None, None, TP)), (P(TP, None, None), P())
    return [{g: col if g in COLUMN_PARALLEL else row for g in layer} for layer in slots]


def _layer_blocks(
    cfg: ModelConfig, layer: int, weights: dict, max_rank: int, dtype, tp: int = 1, xp=jnp
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """One layer's groups of `weights` as one slot: group -> (a [in, Rg], b [Rg, out]) in `empty_slots`' layout,
    target j's factors at rows/columns j*max_rank.. (zero-padded to max_rank) and b's output columns its own
    (device-major for tp > 1 in the column-parallel groups). Built by pad/concatenate/gather only, so differentiable
    in every factor; xp: the array module (numpy builds them on the host)."""
    blocks = {}
    for g, (fan_in, outs) in _group_shapes(cfg, layer).items():
        fan_out, a_parts, b_parts, offset = sum(n for _, n in outs), [], [], 0
        for t, width in outs:
            wa, wb = weights.get((layer, t), (None, None))
            if wa is None:
                a_parts.append(xp.zeros((fan_in, max_rank), dtype))
                b_parts.append(xp.zeros((max_rank, fan_out), dtype))
            else:
                r = wa.shape[-1]
                if wa.shape != (fan_in, r) or wb.shape != (r, width):
                    raise LoRAError(
                        f"layer {layer} {t}: a {list(wa.shape)} and b {list(wb.shape)} do not fit the projection "
                        f"[{fan_in} -> {width}] (expected [{fan_in}, r] and [r, {width}])"
                    )
                if r > max_rank:
                    raise LoRAError(f"layer {layer} {t} has rank {r}, over the slots' {max_rank}")
                a_parts.append(xp.pad(xp.asarray(wa, dtype), ((0, 0), (0, max_rank - r))))
                b_parts.append(xp.pad(xp.asarray(wb, dtype), ((0, max_rank - r), (offset, fan_out - offset - width))))
            offset += width
        b = xp.concatenate(b_parts, axis=0)  # [Rg, out]
        if tp > 1 and g in COLUMN_PARALLEL:
            b = b[:, _device_major([w for _, w in outs], tp)]
        blocks[g] = (xp.concatenate(a_parts, axis=1), b)
    return blocks


def _check_keys(cfg: ModelConfig, weights: dict) -> None:
    for layer, target in weights:
        if not (isinstance(layer, int) and 0 <= layer < cfg.num_layers and target in target_shapes(cfg, layer)):
            raise LoRAError(
                f"adapter weights key {(layer, target)!r}: not a target of this model (layers 0..{cfg.num_layers - 1}"
                f", targets {', '.join(TARGETS)}, MLP ones in dense layers)"
            )


def adapter_slots(
    cfg: ModelConfig, weights: dict[tuple[int, str], tuple[jax.Array, jax.Array]], max_rank: int, dtype=jnp.float32
) -> list[LayerLoRA]:
    """An adapter's factors (`LoRAAdapter.weights`: (layer, target) -> (a [in, r], b [r, out])) as one slot of the
    forward's layout: per layer {group: (a [in, 1, Rg], b [1, Rg, out])}, Rg = max_rank times the group's targets,
    each target zero-padded to max_rank and zeros where the adapter leaves a target. Pass it as
    `forward_dense(..., lora=adapter_slots(...), lora_slot=0)`.

    Differentiable (jnp pad/concatenate, no assignment): `jax.grad` of a loss of the forward with respect to
    `weights` gives a dict of the same keys with (d a [in, r], d b [r, out]) (the scale is folded into b, so d b is
    the gradient of the folded factor). Shapes are static: the padding and layout are fixed by cfg, max_rank and the
    weights' keys and ranks. Raises LoRAError for a key the model lacks, a shape that does not fit its projection or
    a rank over max_rank."""
    _check_keys(cfg, weights)
    out = []
    for i in range(cfg.num_layers):
        blocks = _layer_blocks(cfg, i, weights, max_rank, dtype)
        out.append({g: (a[:, None, :], b[None]) for g, (a, b) in blocks.items()})
    return out


def set_slot(
    cfg: ModelConfig, slots: list[LayerLoRA], slot: int, adapter: LoRAAdapter | None, tp: int = 1
) -> list[LayerLoRA]:
    """`slots` with slot `slot` holding `adapter` (zero-padded to the slots' rank; targets it leaves are zeroed), or
    cleared when adapter is None; tp: the tensor-parallel size the slots serve (column-parallel B device-major, see
    the module docstring). Functional: returns new arrays (differentiable in the adapter's factors, as
    `adapter_slots`, whose layout it writes for tp = 1)."""
    return write_slot(slots, slot, slot_blocks(cfg, adapter, slots, tp, xp=jnp))


def slot_blocks(
    cfg: ModelConfig, adapter: LoRAAdapter | None, slots: list[LayerLoRA], tp: int = 1, xp=np
) -> list[dict]:
    """What `set_slot` writes into one slot of `slots`: per layer {group: (a [in, Rg], b [Rg, out])} in the slots'
    dtypes (zeros for None: a cleared slot), built with the array module `xp` (numpy: on the host, as a server
    loads an adapter; jnp: differentiable). LoRAError naming the adapter for weights that do not fit the model or
    the slots' rank."""
    max_rank = slots[0]["o"][0].shape[2]  # the o group has one target: its Rg is the slots' rank
    weights = {} if adapter is None else adapter.weights
    try:
        _check_keys(cfg, weights)
        out = []
        for i, layer in enumerate(slots):
            blk = _layer_blocks(cfg, i, weights, max_rank, np.float32, tp, xp=xp)
            out.append({g: (blk[g][0].astype(a.dtype), blk[g][1].astype(b.dtype)) for g, (a, b) in layer.items()})
        return out
    except LoRAError as e:
        raise LoRAError(f"adapter {adapter.name!r}: {e}") from None


def write_slot(slots: list[LayerLoRA], slot, blocks: list[dict]) -> list[LayerLoRA]:
    """`slots` with slot `slot` (an int, or an int32 scalar array under jit) holding `blocks` (`slot_blocks`)."""
    return [
        {g: (a.at[:, slot].set(blk[g][0]), b.at[slot].set(blk[g][1])) for g, (a, b) in layer.items()}
        for layer, blk in zip(slots, blocks, strict=True)
    ]


def lora_delta(x: jax.Array, group: tuple[jax.Array, jax.Array], slots: jax.Array, backend: str = "xla") -> jax.Array:
    """Each token's adapter delta for one group of projections that share their input: x [T, in], group = (a [in,
    S, Rg], b [S, Rg, out]), slots [T] int32 (-1: none) -> [T, out] in x's dtype (the group's
    targets' outputs side by side, as the fused weight's). The reference: two plain matmuls over every slot, the
    other slots' columns masked to exact zeros in between, so a token's delta does not depend on which adapters its
    neighbours use (static shapes, one program for every mix); the cost is S times a single adapter's, small next to
    the base matmul at ranks of 8-64. backend: the matmul backend (`netra_jax.quant.matmul.BACKENDS`); the GPU ones
    ("gpu", "gpu_sm80"; "gpu_interpret" in the Pallas interpreter) run the segment matmul of
    `netra_jax.ops.lora_segment` instead (tokens sorted by slot, each multiplied by its own slot's factors only,
    the same result), every other one the reference."""
    if backend in (*GPU_BACKENDS, "gpu_interpret"):
        return lora_segment_delta(x, group, slots, interpret=backend == "gpu_interpret")
    a, b = group
    fan_in, num_slots, group_rank = a.shape
    xa = x @ a.reshape(fan_in, num_slots * group_rank).astype(x.dtype)  # [T, S*Rg]
    cols = jnp.arange(num_slots * group_rank, dtype=slots.dtype) // group_rank  # each column's slot
    xa = jnp.where(slots[:, None] == cols[None, :], xa, jnp.zeros((), xa.dtype))
    return xa @ b.reshape(num_slots * group_rank, -1).astype(x.dtype)  # [T, out]
