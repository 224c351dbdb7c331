"""A GPU kernel's resource budget, declared next to the kernel: what one block of it may use. The GPU compile check
(benchmarks/gpu_compile) compiles every configuration the kernel's selection code can return for the H200 and A100
targets and fails any that spills, goes over the budget or does not compile."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuBudget"]


@dataclass(frozen=True)
class GpuBudget:
    registers: int  # per thread (ptxas' "Used N registers")
    smem_bytes: int  # shared memory per block, static and dynamic
    spill_bytes: int = 0  # register spill stores plus loads

    def violations(self, registers: int | None, spill_bytes: int, smem_bytes: int | None) -> list[str]:
        """What a compiled kernel's report breaks of this budget (a missing figure is a violation too: the check
        must see every kernel it passes)."""
        out = []
        if registers is None:
            out.append("no register count reported")
        elif registers > self.registers:
            out.append(f"{registers} registers > budget {self.registers}")
        if spill_bytes > self.spill_bytes:
            out.append(f"{spill_bytes} bytes of register spills > budget {self.spill_bytes}")
        if smem_bytes is None:
            out.append("no shared-memory size reported")
        elif smem_bytes > self.smem_bytes:
            out.append(f"{smem_bytes} bytes of shared memory > budget {self.smem_bytes}")
        return out
