"""The engine's LoRA adapters: the ones it knows (by LoRARequest), the ones read on the host (LRU, `max_cpu_loras`) and
which of them sit in the runner's device slots (LRU, `max_loras`), loaded into a slot when a step needs them.

Contract: `register` reads and checks an adapter when a request first names it, so a bad adapter fails that request
with a LoRAError (a ValueError naming the file or tensor) and nothing else; `slots_for` is called with the adapters
of one step, which the scheduler keeps to at most `max_loras` distinct ones, so a slot can always be freed: it takes
the least recently used slot that this step does not use. An adapter evicted from the host is read again from its
path when next needed; one given in memory is kept with its request."""

from __future__ import annotations

from collections import OrderedDict

from netra_jax.config import ModelConfig
from netra_jax.engine_config import LoRAConfig
from netra_jax.lora_request import LoRARequest
from netra_jax.models.lora import LoRAAdapter, LoRAError, load_peft_adapter

__all__ = ["LoRASlots"]


class LoRASlots:
    def __init__(self, config: LoRAConfig, model_cfg: ModelConfig, runner) -> None:
        self.config, self.model_cfg, self.runner = config, model_cfg, runner
        self._known: dict[int, LoRARequest] = {}  # lora_int_id -> the request that introduced it
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, least recently used first
        self.num_loads = 0  # adapters written into a device slot (swaps included)

    # ------------------------------------------------------------------ adapters
    def register(self, lora: LoRARequest) -> None:
        """Know `lora` from now on (read and checked now if it is new). ValueError when its id is taken by another
        adapter; LoRAError when it cannot be served on this model."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        known = self._known.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path, known.adapter) != (lora.lora_name, lora.lora_path, lora.adapter):
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r}; "
                    f"{lora.lora_name!r} needs an id of its own"
                )
            return
        self._hold(lora.lora_int_id, self._read(lora))
        self._known[lora.lora_int_id] = lora

    def unregister(self, lora_int_id: int) -> None:
        """Forget an adapter (no running request may use it): its host copy and its slot are freed."""
        self._known.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.runner.set_lora_slot(slot, None)

    @property
    def known(self) -> dict[int, LoRARequest]:
        return dict(self._known)

    @property
    def on_device(self) -> list[int]:
        """Adapter ids in device slots, least recently used first."""
        return list(self._slot_of)

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        rank = self.config.max_lora_rank
        if lora.adapter is not None:
            adapter = lora.adapter
            if not isinstance(adapter, LoRAAdapter):
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: adapter must be a LoRAAdapter")
            if adapter.rank > rank:
                raise LoRAError(f"LoRA adapter {lora.lora_name!r} has rank {adapter.rank}, over max_lora_rank={rank}")
            return adapter
        return load_peft_adapter(lora.lora_path, self.model_cfg, name=lora.lora_name, max_rank=rank)

    def _hold(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_int_id] = adapter
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.config.cpu_loras:
            self._host.popitem(last=False)

    def _adapter(self, lora_int_id: int) -> LoRAAdapter:
        if lora_int_id not in self._host:
            self._hold(lora_int_id, self._read(self._known[lora_int_id]))
        self._host.move_to_end(lora_int_id)
        return self._host[lora_int_id]

    # ------------------------------------------------------------------ slots
    def slots_for(self, lora_ids: set[int]) -> dict[int, int]:
        """The device slot of each adapter of one step (0 excluded: the base model), loading those not in a slot."""
        wanted = {i for i in lora_ids if i}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, over max_loras={self.config.max_loras}")
        for lid in sorted(wanted):
            if lid in self._slot_of:
                self._slot_of.move_to_end(lid)
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self._slot_of if v not in wanted)
                slot = self._slot_of.pop(victim)
            self.runner.set_lora_slot(slot, self._adapter(lid))
            self._slot_of[lid] = slot
            self.num_loads += 1
        return {lid: self._slot_of[lid] for lid in wanted}
