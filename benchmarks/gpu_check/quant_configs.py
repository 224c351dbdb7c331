"""The quantized-weight matmuls of both GPU checks (gpu_check.configs takes them into its kernel list): the Pallas
W4A16 / W8A16 kernel (`ops.packed_matmul_triton`) for the packed formats the engine serves, and the FP8 product
(`ops.fp8_matmul`: W8A8 on XLA's fp8 dot where the GPU has fp8 tensor cores, the W8A16 reference on the others), at
the Llama-3-8B projections and the rows of the three kinds of step (one decode row, a full decode batch, a prefill
chunk) of the device run's engine settings."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check import engine_settings
from netra_jax.ops import fp8_matmul as fp8
from netra_jax.ops import packed_matmul_triton as pmm
from netra_jax.quant import PackedIntWeight, QuantizedWeight, reference_matmul
from netra_jax.targets import GPU_TARGETS

__all__ = ["FORMATS", "PROJECTIONS", "Fp8Case", "PackedCase", "PackedFormat", "fp8_cases", "packed_cases"]

_S = engine_settings.settings(False)
# rows of x: a lone decode step, a full decode batch, a prefill chunk
ROWS = {"decode_1": 1, f"decode_{_S['max_num_seqs']}": _S["max_num_seqs"]}
ROWS[f"prefill_{_S['max_num_batched_tokens']}"] = _S["max_num_batched_tokens"]
# Llama-3-8B's projections (in, out): q and o, k and v, the fused gate/up, down
PROJECTIONS = {"wq": (4096, 4096), "wk": (4096, 1024), "w_gate_up": (4096, 28672), "w_down": (14336, 4096)}


@dataclass(frozen=True)
class PackedFormat:
    """A PackedIntWeight layout the engine serves: bits, group size, zero points, act-order g_idx."""

    name: str
    bits: int
    group: int
    zero: bool
    g_idx: bool


FORMATS = (
    PackedFormat("q4_0", 4, 32, False, False),  # GGUF Q4_0 and --quantization int4 (quant.repack)
    PackedFormat("q8_0", 8, 32, False, False),  # GGUF Q8_0
    PackedFormat("gptq4_g128", 4, 128, True, False),  # GPTQ / AWQ
    PackedFormat("gptq4_g128_act", 4, 128, True, True),  # GPTQ act-order
    PackedFormat("w8_g128", 8, 128, True, False),
)
FLOAT32_FORMATS = ("q4_0",)  # float32 models (dtype="float32") on the Q4_0 kernel


@dataclass(frozen=True)
class PackedCase:
    """One packed-matmul configuration: a format, a projection's K and N, the step's rows, x's dtype and what the
    kernel's selection code returns for them."""

    kernel: str  # "packed_matmul"
    fmt: PackedFormat
    projection: str
    m: int
    k: int
    n: int
    dtype: str
    step: str
    config: pmm.PackedMatmulConfig

    @property
    def name(self) -> str:
        dt = "" if self.dtype == "bfloat16" else f"/{self.dtype}"
        return f"{self.kernel}/{self.fmt.name}{dt}/{self.projection}/{self.step}"

    @property
    def key(self) -> tuple:
        c = self.config
        ragged = (self.k % c.block_k != 0, self.n % c.block_n != 0)
        return (self.kernel, self.dtype, dataclasses.astuple(self.fmt)[1:], dataclasses.astuple(c), ragged)

    def describe(self) -> dict:
        return {"format": self.fmt.name, "step": self.step, "matmul": f"{self.projection} {self.k}x{self.n}"}

    def function(self, interpret: bool = False):
        f = self.fmt
        return functools.partial(
            pmm.packed_matmul_triton, bits=f.bits, group=f.group, config=self.config, interpret=interpret
        )

    def _shapes(self) -> list[tuple[tuple[int, ...], jnp.dtype] | None]:
        f, k, n = self.fmt, self.k, self.n
        groups = k // f.group
        return [
            ((self.m, k), jnp.dtype(self.dtype)),  # x
            ((k * f.bits // 32, n), jnp.dtype(jnp.int32)),  # packed
            ((groups, n), jnp.dtype(jnp.float16)),  # scale
            ((groups, n), jnp.dtype(jnp.int32)) if f.zero else None,  # zero
            ((k,), jnp.dtype(jnp.int32)) if f.g_idx else None,  # g_idx
        ]

    def abstract_args(self, sharding=None) -> tuple:
        return tuple(None if s is None else jax.ShapeDtypeStruct(*s, sharding=sharding) for s in self._shapes())

    def inputs(self, seed: int = 0) -> tuple:
        """Random x, words of random values, scales about 1 / sqrt(K) of a unit-variance weight, zero points near
        the middle and a permuted g_idx."""
        f, k = self.fmt, self.k
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((self.m, k)), self.dtype)
        packed = jnp.asarray(rng.integers(-(2**31), 2**31, (k * f.bits // 32, self.n), dtype=np.int64), jnp.int32)
        top = (1 << f.bits) - 1
        scale = jnp.asarray(rng.uniform(0.5, 1.5, (k // f.group, self.n)) * 2 / top / k**0.5, jnp.float16)
        zero = jnp.asarray(rng.integers(top // 2 - 1, top // 2 + 2, scale.shape), jnp.int32) if f.zero else None
        g_idx = jnp.asarray(rng.permutation(np.arange(k) // f.group), jnp.int32) if f.g_idx else None
        return x, packed, scale, zero, g_idx

    def reference(self, x, packed, scale, zero, g_idx):
        f = self.fmt
        w = PackedIntWeight(packed, scale, zero, g_idx, bits=f.bits, group=f.group, shape=(self.k, self.n))
        return pmm.packed_matmul_reference(x, w, jnp.float32)


def packed_cases() -> list[PackedCase]:
    out = []
    for fmt in FORMATS:
        for dtype in ("bfloat16", "float32") if fmt.name in FLOAT32_FORMATS else ("bfloat16",):
            for proj, (k, n) in PROJECTIONS.items():
                for step, m in ROWS.items():
                    cfg = pmm.choose_config(m, k, n, jnp.dtype(dtype).itemsize)
                    out.append(PackedCase("packed_matmul", fmt, proj, m, k, n, dtype, step, cfg))
    return out


@dataclass(frozen=True)
class Fp8Case:
    """One FP8-weight product (`QuantizedWeight` float8_e4m3fn): W8A8 through XLA's fp8 dot where `native` (a GPU with
    fp8 tensor cores), else the W8A16 reference (the weight widened inside XLA's GEMM). Not a Pallas kernel: the
    compile check judges its compiled HLO (`gpu_compile.capture.gemms`) instead of a ptxas report."""

    kernel: str  # "fp8"
    native: bool
    projection: str
    m: int
    k: int
    n: int
    step: str
    dtype: str = "bfloat16"
    config: None = None

    @property
    def name(self) -> str:
        return f"{self.kernel}/{'w8a8' if self.native else 'w8a16'}/{self.projection}/{self.step}"

    @property
    def key(self) -> tuple:
        return (self.kernel, self.native, self.projection, self.step)

    @property
    def weight_bytes(self) -> int:
        return self.k * self.n

    def describe(self) -> dict:
        return {"step": self.step, "matmul": f"{self.projection} {self.k}x{self.n}", "native_fp8": self.native}

    def function(self, interpret: bool = False):
        if self.native:
            return fp8.fp8_matmul
        return lambda x, q, scale: reference_matmul(x, QuantizedWeight(q, scale))

    def abstract_args(self, sharding=None) -> tuple:
        return (
            jax.ShapeDtypeStruct((self.m, self.k), jnp.dtype(self.dtype), sharding=sharding),
            jax.ShapeDtypeStruct((self.k, self.n), jnp.float8_e4m3fn, sharding=sharding),
            jax.ShapeDtypeStruct((self.n,), jnp.float32, sharding=sharding),
        )

    def inputs(self, seed: int = 0) -> tuple:
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((self.m, self.k)), self.dtype)
        q = jnp.asarray(rng.uniform(-448, 448, (self.k, self.n)), jnp.float8_e4m3fn)
        scale = jnp.asarray(rng.uniform(0.5, 1.5, self.n) / 448 / self.k**0.5, jnp.float32)
        return x, q, scale

    def reference(self, x, q, scale):
        """The same rounding in float32: x's rows through e4m3 (W8A8) or as they are (W8A16)."""
        if self.native:
            return fp8.fp8_matmul_reference(x, q, scale)
        with jax.default_matmul_precision("highest"):
            return reference_matmul(x.astype(jnp.float32), QuantizedWeight(q, scale))


def fp8_cases(target: str) -> list[Fp8Case]:
    native = float(GPU_TARGETS[target].compute_capability) >= 8.9  # fp8 GEMMs from Ada / Hopper on
    return [
        Fp8Case("fp8", native, proj, m, k, n, step) for proj, (k, n) in PROJECTIONS.items() for step, m in ROWS.items()
    ]
