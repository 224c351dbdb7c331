"""LoRARequest: which LoRA adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`), by a PEFT directory
or, for research, an adapter already in memory (`netra_jax.models.lora.LoRAAdapter`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LoRARequest"]


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (what the server lists and requests select by `model`). lora_int_id: its id, a
    positive integer unique per adapter (the engine keys its slots and prefix cache by it). lora_path: a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors). adapter: a `LoRAAdapter` in memory instead of a
    path (e.g. one trained with jax.grad through the forward); base_model_name: informational, as vLLM's."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    adapter: Any = None  # netra_jax.models.lora.LoRAAdapter

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if bool(self.lora_path) == (self.adapter is not None):
            raise ValueError(f"LoRA adapter {self.lora_name!r}: give one of lora_path and adapter")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
