"""The GPUs the compile check compiles for, without one: each target's XLA device description (targets/*.txtpb), the
facts the check reads from it, and the compile-only device of its topology that programs are lowered for."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent / "targets"


@dataclass(frozen=True)
class Target:
    name: str  # "h200" | "a100"
    file: str  # the device description in targets/
    arch: str  # what ptxas compiles for
    compute_capability: str  # as jax reports it on the device ("9.0")

    @functools.cached_property
    def description(self) -> str:
        return (HERE / self.file).read_text()

    def _field(self, name: str) -> int:
        m = re.search(rf"^\s*{name}:\s*(\d+)", self.description, re.M)
        if m is None:
            raise ValueError(f"{self.file} has no {name}")
        return int(m.group(1))

    @property
    def device_memory(self) -> int:
        """Bytes of device memory."""
        return self._field("device_memory_size")

    @property
    def smem_per_block(self) -> int:
        """The most shared memory one block may opt in to."""
        return self._field("shared_memory_per_block_optin")


TARGETS = {
    "h200": Target("h200", "h200.txtpb", "sm_90a", "9.0"),
    "a100": Target("a100", "a100_sxm_80.txtpb", "sm_80", "8.0"),
}


@functools.cache
def device(name: str):
    """The compile-only device of a one-GPU topology of target `name` (needs the CUDA plugin, not a GPU)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=TARGETS[name].description)
    return topo.devices[0]
