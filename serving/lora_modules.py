"""The server's LoRA adapters by name (vLLM's --lora-modules and its load / unload routes): what a request's `model`
may name besides the base model, each with the LoRARequest the engine runs it as (ids given in order, never reused)."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from netra_jax.lora_request import LoRARequest

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine

__all__ = ["LoRAModule", "ServedAdapters", "parse_lora_modules"]


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModule]:
    """--lora-modules values, vLLM's two forms: `name=path`, or JSON `{"name": ..., "path": ...,
    "base_model_name": ...}`. ValueError naming the bad one."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {v!r}: not JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules {v!r}: a JSON module needs string 'name' and 'path'")
            unknown = set(d) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules {v!r}: unknown keys {sorted(unknown)}")
            out.append(LoRAModule(d["name"], d["path"], d.get("base_model_name")))
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {v!r}: expected name=path or a JSON object")
            out.append(LoRAModule(name, path))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name given twice in {names}")
    return out


class ServedAdapters:
    """name -> LoRARequest, safe to read and change from the server's threads."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @classmethod
    def loaded(cls, engine: LLMEngine, modules: list[LoRAModule] | None) -> ServedAdapters:
        """The adapters of `modules` (--lora-modules), each read and checked now by `load` (LoRAError names a bad
        one)."""
        adapters = cls()
        for module in modules or []:
            adapters.load(engine, module)
        return adapters

    def load(self, engine: LLMEngine, module: LoRAModule) -> LoRARequest:
        """Serve `module` under its name, with a fresh id: read and checked by `engine.add_lora` first (LoRAError
        naming the problem; nothing is added then). ValueError when the name is taken."""
        with self._lock:
            if module.name in self._by_name:
                raise ValueError(f"a LoRA adapter named {module.name!r} is already loaded")
            lora = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)
        engine.add_lora(lora)
        with self._lock:
            if self._by_name.setdefault(lora.lora_name, lora) is not lora:  # a concurrent load of the same name won
                raise ValueError(f"a LoRA adapter named {module.name!r} is already loaded")
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
