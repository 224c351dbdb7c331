"""The machines programs are compiled for ahead of time: the host's CPU, and NVIDIA GPUs described by XLA's device
descriptions (the *.txtpb files here), for which a machine without a GPU compiles through a compile-only device."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GPU_TARGETS", "TARGETS", "GpuTarget", "compile_device", "gpu_target_of"]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model: its XLA device description and what the engine and the compile check read from it."""

    name: str  # "h100" | "h200" | "a100"
    file: str  # the device description here
    arch: str  # what ptxas compiles for
    compute_capability: str  # as jax reports it on the device ("9.0")

    @functools.cached_property
    def description(self) -> str:
        return (HERE / self.file).read_text()

    def _field(self, name: str) -> str:
        m = re.search(rf'^\s*{name}:\s*"?([^"\n]+)"?', self.description, re.M)
        if m is None:
            raise ValueError(f"{self.file} has no {name}")
        return m.group(1)

    @property
    def device_kind(self) -> str:
        """What jax reports as the device's kind on this GPU ("NVIDIA H100 80GB HBM3")."""
        return self._field("device_description_str")

    @property
    def device_memory(self) -> int:
        """Bytes of device memory."""
        return int(self._field("device_memory_size"))

    @property
    def memory_bandwidth(self) -> int:
        """Bytes per second of device memory bandwidth, as the description gives it."""
        return int(self._field("memory_bandwidth"))

    @property
    def smem_per_block(self) -> int:
        """The most shared memory one block may opt in to."""
        return int(self._field("shared_memory_per_block_optin"))


GPU_TARGETS = {
    "h100": GpuTarget("h100", "h100_sxm.txtpb", "sm_90a", "9.0"),
    "h200": GpuTarget("h200", "h200.txtpb", "sm_90a", "9.0"),
    "a100": GpuTarget("a100", "a100_sxm_80.txtpb", "sm_80", "8.0"),
}
TARGETS = ("cpu", *GPU_TARGETS)  # what `netra-jax compile --target` takes


def gpu_target_of(device_kind: str) -> str | None:
    """The target whose description names this device kind (jax's `device.device_kind`), or None."""
    for name, target in GPU_TARGETS.items():
        if target.device_kind == device_kind:
            return name
    return None


@functools.cache
def compile_device(name: str):
    """The compile-only device of a one-GPU topology of target `name`: programs lowered for it compile for that GPU
    without one (needs jax's CUDA plugin importable, not a GPU or its driver)."""
    from jax.experimental import topologies

    description = GPU_TARGETS[name].description
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=description)
    except NotImplementedError as e:  # no CUDA plugin: jax knows no "cuda" topology
        raise RuntimeError(
            f"compiling for {name} needs jax's CUDA plugin (pip install 'jax[cuda13]', or `make gpu-compile-setup` "
            f"and its directory on PYTHONPATH); no GPU is needed ({e})"
        ) from None
    return topo.devices[0]
