"""The GPU configurations both GPU checks take from one list: the compile check (benchmarks/gpu_compile, CI, no GPU)
compiles them for the H200 and A100 targets, the device run (section `kernels` of gpu_check.sh) compiles and runs
the same ones on the GPU it finds. Kernel cases: every attention-kernel configuration the selection code
(`choose_config` of each kernel) returns for the served model shapes at the engine's step shapes; step programs: the
engine's steps for two model shapes at every token bucket the warm-up compiles."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check import engine_settings, quant_configs
from benchmarks.gpu_check.model_dir import LLAMA31_8B
from benchmarks.gpu_check.quant_configs import Fp8Case, PackedCase, fp8_cases, packed_cases
from netra_jax.ops import grouped_matmul_triton as gmm
from netra_jax.ops import packed_matmul_triton as pmm
from netra_jax.ops import paged_attention_mosaic as mosaic
from netra_jax.ops import paged_attention_triton as triton
from netra_jax.ops.attention import AttentionMetadata, paged_attention_reference
from netra_jax.ops.kv_quant import QuantizedPages, dequantize_pages, quantize

__all__ = [
    "SHAPES",
    "DECODE_FULL",
    "PREFILL_FULL",
    "STEPS",
    "STEP_MODELS",
    "QUANT_STEPS",
    "TARGET_KERNELS",
    "AttentionShape",
    "KernelCase",
    "MatmulCase",
    "MoeShape",
    "Step",
    "dry_cases",
    "kernel_cases",
    "shape",
    "step",
]


@dataclass(frozen=True)
class AttentionShape:
    """The attention of one served model's layers: heads, head width and the options the kernels branch on."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


# The served families' attention shapes, chosen to span what the kernels branch on: head_dim 64 / 80 / 96 / 128 / 256,
# GQA groups 1, 2, 3, 4, 7, 8, 16, sliding windows, soft-capping and sinks. Models with both local and global layers
# (Gemma 2 and 3, gpt-oss) run both variants.
SHAPES = (
    AttentionShape("llama3-8b", 32, 8, 128),  # also Mistral 7B, Mixtral, Qwen3-8B
    AttentionShape("llama3-70b", 64, 8, 128),
    AttentionShape("qwen3-30b-a3b", 32, 4, 128),  # the MoE step programs' model (its kernels are llama3-70b's)
    AttentionShape("qwen2.5-7b", 28, 4, 128),
    AttentionShape("qwen3-235b-a22b", 64, 4, 128),
    AttentionShape("llama2-7b", 32, 32, 128),
    AttentionShape("smollm2-135m", 9, 3, 64),
    AttentionShape("smollm2-1.7b", 32, 32, 64),
    AttentionShape("gemma3-1b-local", 4, 1, 256, sliding_window=512),
    AttentionShape("gemma3-1b-global", 4, 1, 256),
    AttentionShape("gemma3-4b-local", 8, 4, 256, sliding_window=1024),
    AttentionShape("gemma3-27b-local", 32, 16, 128, sliding_window=1024),
    AttentionShape("gemma2-9b-local", 16, 8, 256, sliding_window=4096, soft_cap=50.0),
    AttentionShape("gemma2-9b-global", 16, 8, 256, soft_cap=50.0),
    AttentionShape("gpt-oss-20b-local", 64, 8, 64, sliding_window=128, sinks=True),
    AttentionShape("gpt-oss-20b-global", 64, 8, 64, sinks=True),
    AttentionShape("phi3-mini", 32, 32, 96),  # head widths Mosaic does not take: Triton everywhere
    AttentionShape("phi2", 32, 32, 80),
)
_BY_NAME = {s.name: s for s in SHAPES}
# float32 models (a float32 checkpoint or dtype="float32") run the Triton kernel on every GPU
FLOAT32_SHAPES = ("smollm2-135m", "llama3-8b", "gemma3-1b-local", "gpt-oss-20b-local")
# quantized KV caches (--kv-cache-dtype int8 / fp8 / fp8_e5m2) run the Triton kernel, which widens int8 / fp8 tiles in
# registers: one shape per head width it branches on (and the options), bf16 queries and float32 ones
KV_QUANT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
KV_QUANT_SHAPES = {"llama3-8b": "bfloat16", "gemma3-1b-local": "bfloat16", "gpt-oss-20b-local": "bfloat16"}
KV_QUANT_SHAPES |= {"smollm2-135m": "float32"}

# Mosaic moves TILE // page_size pages per TMA step (or slices of pages longer than a tile): every page size the
# kernel takes, for one shape of each head width (the tile follows the head width)
PAGE_SWEEP = {"gpt-oss-20b-local": (32, 64, 128, 256), "llama3-8b": (32, 64, 128, 256), "gemma3-4b-local": (32, 64)}
DEFAULT_PAGE = engine_settings.settings(False)["page_size"]


@dataclass(frozen=True)
class Step:
    """A step shape the engine calls attention with: T tokens (a token bucket) of S sequences (the runner's
    min(T, max_seqs_bucket)), block tables of `max_pages` = ceil(max_model_len / page_size) entries."""

    name: str
    num_tokens: int
    num_seqs: int
    max_model_len: int

    def max_pages(self, page_size: int) -> int:
        return -(-self.max_model_len // page_size)


_S = engine_settings.settings(False)
# The three kinds of step the selection code tells apart: a lone decode over a long context (split-K at its most), a
# full decode batch (no split) and a prefill step (64-row query blocks), at the engine settings of the device run.
DECODE_FULL = f"decode_{_S['max_num_seqs']}"  # every sequence decoding: decode_512
PREFILL_FULL = f"prefill_{_S['max_num_batched_tokens']}"  # a full step of prompt tokens: prefill_8192
STEPS = (
    Step("decode_1", 1, 1, 32768),
    Step(DECODE_FULL, _S["max_num_seqs"], _S["max_num_seqs"], _S["max_model_len"]),
    Step(PREFILL_FULL, _S["max_num_batched_tokens"], _S["max_num_seqs"], _S["max_model_len"]),
)

# kernels each target compiles: Mosaic GPU exists on Hopper only; Triton is the fallback everywhere (and a choice);
# the grouped matmul (Triton) runs the experts of MoE models on every CUDA GPU, the packed matmul (Triton) the W4A16 /
# W8A16 weights; fp8 weights run XLA's fp8 dot on Hopper and the W8A16 reference on the A100 (gpu_check.quant_configs)
TARGET_KERNELS = {
    "h100": ("mosaic", "triton", "grouped_matmul", "packed_matmul", "fp8"),
    "h200": ("mosaic", "triton", "grouped_matmul", "packed_matmul", "fp8"),
    "a100": ("triton", "grouped_matmul", "packed_matmul", "fp8"),
}


@dataclass(frozen=True)
class KernelCase:
    """One attention-kernel configuration: the kernel, the model shape and dtype, the page size and the step it is
    called at, and the static configuration the kernel's selection code returns for them."""

    kernel: str  # "mosaic" | "triton"
    shape: AttentionShape
    dtype: str  # "bfloat16" | "float32"
    page_size: int
    step: Step
    config: mosaic.MosaicConfig | triton.KernelConfig
    kv_dtype: str | None = None  # a quantized KV cache's storage type ("int8", "float8_e4m3fn", ...); None: dtype

    @property
    def name(self) -> str:
        dt = "" if self.dtype == "bfloat16" else f"/{self.dtype}"
        kv = "" if self.kv_dtype is None else f"/kv-{self.kv_dtype}"
        return f"{self.kernel}/{self.shape.name}{dt}{kv}/p{self.page_size}/{self.step.name}"

    @property
    def key(self) -> tuple:
        """What the compiled kernel depends on: two cases with one key build the same kernel body (the split count
        and the sizes of the arrays are runtime values or launch dimensions)."""
        s, c = self.shape, self.config
        features = (s.sliding_window is not None, s.soft_cap is not None)
        if self.kernel == "mosaic":  # the sinks are applied outside the kernel
            chunks = c.tile // min(self.page_size, c.tile)
            layout = (chunks, self.page_size > c.tile)
            cfg = (c.tile, c.num_stages, c.num_splits > 1, c.block_rows, c.p_in_registers)
            return ("mosaic", self.dtype, s.head_dim, s.group, layout, cfg, features)
        cfg = (c.block_m, c.tile, c.num_splits > 1, c.num_warps, c.num_stages)
        return ("triton", self.dtype, self.kv_dtype, s.head_dim, s.group, self.page_size, cfg, (*features, s.sinks))

    def num_pages(self) -> int:
        """Pages of the cache the case is compiled (and run) with: 64 MiB of keys, at least one sequence's table."""
        s = self.shape
        per_page = self.page_size * s.kv_heads * s.head_dim * jnp.dtype(self.dtype).itemsize
        return max(self.step.max_pages(self.page_size), min(4096, (64 << 20) // per_page))

    def describe(self) -> dict:
        return {
            "shape": self.shape.name,
            "step": self.step.name,
            "page_size": self.page_size,
            "kv_dtype": self.kv_dtype,
        }

    def _options(self) -> dict:
        s = self.shape
        return dict(scale=s.head_dim**-0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap)

    def function(self, interpret: bool = False):
        """The kernel's entry point with this case's static options and configuration bound, taking the arguments
        of `abstract_args` / `inputs`: f(q, k, v, md, sinks)."""
        fn = {"mosaic": mosaic.paged_attention_mosaic, "triton": triton.paged_attention_triton}[self.kernel]
        config = self.config
        if interpret and self.kernel == "mosaic":  # the interpreter's wgmma reads P from SMEM: same arithmetic
            config = dataclasses.replace(config, p_in_registers=False)
        bound = functools.partial(fn, interpret=interpret, config=config, **self._options())
        return lambda q, k, v, md, sinks: bound(q, k, v, md, sinks=sinks)

    def reference(self, q, k, v, md, sinks):
        """The jnp reference on the same inputs, in float32 at full precision."""
        f32 = [q.astype(jnp.float32), dequantize_pages(k), dequantize_pages(v)]
        with jax.default_matmul_precision("highest"):
            return paged_attention_reference(*f32, md, sinks=sinks, **self._options())

    def abstract_args(self, sharding=None) -> tuple:
        """(q, k_pages, v_pages, md, sinks) as ShapeDtypeStructs (placed by `sharding`, e.g. a compile-only GPU)."""
        s, st, dt = self.shape, self.step, jnp.dtype(self.dtype)

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        T, S, W = st.num_tokens, st.num_seqs, st.max_pages(self.page_size)
        pages = (self.num_pages(), self.page_size, s.kv_heads, s.head_dim)
        md = AttentionMetadata(
            slot_mapping=sds((T,), jnp.int32),
            query_start_loc=sds((S + 1,), jnp.int32),
            seq_lens=sds((S,), jnp.int32),
            block_tables=sds((S, W), jnp.int32),
        )
        sinks = sds((s.q_heads,), jnp.float32) if s.sinks else None

        def cache():  # one K or V cache: float pages, or quantized values and their scales
            if self.kv_dtype is None:
                return sds(pages, dt)
            return QuantizedPages(sds(pages, jnp.dtype(self.kv_dtype)), sds(pages[:3], jnp.float32))

        return sds((T, s.q_heads, s.head_dim), dt), cache(), cache(), md, sinks

    def inputs(self, seed: int = 0, max_context: int = 4096) -> tuple:
        """Concrete (q, k_pages, v_pages, md, sinks) of the abstract shapes: a ragged batch of the step's kind (every
        sequence one token for decode steps, prompt chunks for prefill), contexts up to `max_context` keys, block
        tables drawn from the cache's pages (sequences may share pages: attention only reads them)."""
        s, st = self.shape, self.step
        T, S, W = st.num_tokens, st.num_seqs, st.max_pages(self.page_size)
        rng = np.random.default_rng(seed)
        if T <= S:  # decode: one token per sequence
            q_lens = np.ones(S, np.int64)
        else:  # prefill: the step's tokens in chunks spread over the sequences
            q_lens = np.full(S, T // S)
            q_lens[: T % S] += 1
        limit = min(max_context, W * self.page_size)
        ctx = rng.integers(q_lens, np.maximum(q_lens, limit) + 1)  # [S] context after this step, >= its new tokens
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_pages = self.num_pages()
        md = AttentionMetadata(
            slot_mapping=jnp.full((T,), num_pages * self.page_size, jnp.int32),  # attention does not read it
            query_start_loc=jnp.asarray(qsl),
            seq_lens=jnp.asarray(ctx.astype(np.int32)),
            block_tables=jnp.asarray(rng.integers(0, num_pages, (S, W)).astype(np.int32)),
        )
        keys = jax.random.split(jax.random.key(seed), 4)
        dt = jnp.dtype(self.dtype)
        pages = (num_pages, self.page_size, s.kv_heads, s.head_dim)
        q = jax.random.normal(keys[0], (T, s.q_heads, s.head_dim), dt)
        k, v = (jax.random.normal(key, pages, dt) for key in keys[1:3])
        if self.kv_dtype is not None:
            k, v = (QuantizedPages(*quantize(x, jnp.dtype(self.kv_dtype))) for x in (k, v))
        sinks = jax.random.normal(keys[3], (s.q_heads,), jnp.float32) if s.sinks else None
        return q, k, v, md, sinks


def shape(name: str) -> AttentionShape:
    return _BY_NAME[name]


def step(name: str) -> Step:
    return next(s for s in STEPS if s.name == name)


def _choose(kernel: str, shape: AttentionShape, dtype: str, page_size: int, step: Step, kv_dtype: str | None = None):
    """What the kernel's selection code returns for this call (as the kernel's own entry point calls it); kv_dtype:
    a quantized cache's storage type."""
    s = shape
    args = (step.num_tokens, step.num_seqs, s.group, s.kv_heads, s.head_dim, page_size)
    context = step.max_pages(page_size) * page_size
    if kernel == "mosaic":
        return mosaic.choose_config(*args, context)
    return triton.choose_config(*args, context, jnp.dtype(dtype).itemsize, kv_dtype is not None)


def _supported(kernel: str, shape: AttentionShape, dtype: str, page_size: int) -> bool:
    if kernel == "triton":
        return True
    return mosaic.supports(dtype, dtype, shape.q_heads, shape.kv_heads, shape.head_dim, page_size) is None


def _candidates(kernel: str):
    """(shape, dtype, page size) triples of one kernel, in order: the default page size first, then the sweep."""
    for shape in SHAPES:
        for dtype in ("bfloat16", "float32") if shape.name in FLOAT32_SHAPES else ("bfloat16",):
            yield shape, dtype, DEFAULT_PAGE
    if kernel == "mosaic":
        for name, pages in PAGE_SWEEP.items():
            for page in pages:
                yield _BY_NAME[name], "bfloat16", page


def _attention_cases(kernel: str):
    for shape, dtype, page in _candidates(kernel):
        if _supported(kernel, shape, dtype, page):
            for step in STEPS:
                yield KernelCase(kernel, shape, dtype, page, step, _choose(kernel, shape, dtype, page, step))
    if kernel == "triton":  # quantized KV caches
        for name, dtype in KV_QUANT_SHAPES.items():
            for kv in KV_QUANT_DTYPES:
                for step in STEPS:
                    config = _choose(kernel, _BY_NAME[name], dtype, DEFAULT_PAGE, step, kv)
                    yield KernelCase(kernel, _BY_NAME[name], dtype, DEFAULT_PAGE, step, config, kv_dtype=kv)


@functools.cache
def kernel_cases(target: str) -> tuple[KernelCase | MatmulCase | PackedCase | Fp8Case, ...]:
    """Every kernel configuration `target` ("h100" | "h200" | "a100") can be asked to run, one case per distinct
    kernel body (`key`: the first case met stands for the others)."""
    out, seen = [], set()
    listed = {"grouped_matmul": matmul_cases, "packed_matmul": packed_cases, "fp8": lambda: fp8_cases(target)}
    for kernel in TARGET_KERNELS[target]:
        for case in listed[kernel]() if kernel in listed else _attention_cases(kernel):
            if case.key not in seen:
                seen.add(case.key)
                out.append(case)
    return tuple(out)


# ------------------------------------------------------------------ grouped matmul (mixture-of-experts MLPs)


@dataclass(frozen=True)
class MoeShape:
    """The expert MLPs of one served mixture-of-experts model: two grouped matmuls per layer, gate/up
    [hidden -> 2 * inter] and down [inter -> hidden], over tokens * top_k rows."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int

    def matmuls(self) -> tuple[tuple[str, int, int], ...]:
        return (("gate_up", self.hidden, 2 * self.inter), ("down", self.inter, self.hidden))


MOE_SHAPES = (
    MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768),
    MoeShape("qwen3-235b-a22b", 128, 8, 4096, 1536),
    MoeShape("mixtral-8x7b", 8, 2, 4096, 14336),
    MoeShape("gpt-oss-20b", 32, 4, 2880, 2880),
)
FLOAT32_MOE = ("qwen3-30b-a3b",)


@dataclass(frozen=True)
class MatmulCase:
    """One grouped-matmul configuration: the model's matmul (K, N over its experts), the step's rows, the dtype and
    what the kernel's selection code returns for them."""

    kernel: str  # "grouped_matmul"
    shape: MoeShape
    matmul: str  # "gate_up" | "down"
    k: int
    n: int
    dtype: str
    step: Step
    config: gmm.GroupedMatmulConfig

    @property
    def rows(self) -> int:
        return self.step.num_tokens * self.shape.top_k

    @property
    def name(self) -> str:
        dt = "" if self.dtype == "bfloat16" else f"/{self.dtype}"
        return f"{self.kernel}/{self.shape.name}{dt}/{self.matmul}/{self.step.name}"

    @property
    def key(self) -> tuple:
        c = self.config
        ragged = (self.k % c.block_k != 0, self.n % c.block_n != 0)
        return (self.kernel, self.dtype, dataclasses.astuple(c), ragged)

    def describe(self) -> dict:
        return {"shape": self.shape.name, "step": self.step.name, "matmul": f"{self.matmul} {self.k}x{self.n}"}

    def function(self, interpret: bool = False):
        return functools.partial(gmm.grouped_matmul_triton, config=self.config, interpret=interpret)

    def abstract_args(self, sharding=None) -> tuple:
        dt = jnp.dtype(self.dtype)
        return (
            jax.ShapeDtypeStruct((self.rows, self.k), dt, sharding=sharding),
            jax.ShapeDtypeStruct((self.shape.experts, self.k, self.n), dt, sharding=sharding),
            jax.ShapeDtypeStruct((self.shape.experts,), jnp.int32, sharding=sharding),
        )

    def inputs(self, seed: int = 0) -> tuple:
        """Random rows routed to random experts (sizes from a top-k routing: some experts empty at decode)."""
        rng = np.random.default_rng(seed)
        E = self.shape.experts
        experts = np.stack([rng.permutation(E)[: self.shape.top_k] for _ in range(self.step.num_tokens)])
        sizes = np.bincount(experts.reshape(-1), minlength=E).astype(np.int32)
        kx, kw = jax.random.split(jax.random.key(seed))
        dt = jnp.dtype(self.dtype)
        rows = jax.random.normal(kx, (self.rows, self.k), dt)
        w = (jax.random.normal(kw, (E, self.k, self.n), dt) * self.k**-0.5).astype(dt)
        return rows, w, jnp.asarray(sizes)

    def reference(self, rows, w, sizes):
        with jax.default_matmul_precision("highest"):
            return gmm.grouped_matmul_reference(rows.astype(jnp.float32), w.astype(jnp.float32), sizes)


def matmul_cases() -> list[MatmulCase]:
    out = []
    for shape in MOE_SHAPES:
        for dtype in ("bfloat16", "float32") if shape.name in FLOAT32_MOE else ("bfloat16",):
            for matmul, k, n in shape.matmuls():
                for st in STEPS:
                    rows = st.num_tokens * shape.top_k
                    cfg = gmm.choose_config(rows, shape.experts, k, n, jnp.dtype(dtype).itemsize)
                    out.append(MatmulCase("grouped_matmul", shape, matmul, k, n, dtype, st, cfg))
    return out


def dry_cases() -> tuple[KernelCase | MatmulCase, ...]:
    """One small case of each kernel for the CPU dry run of the device check (the interpreters are slow): the same
    case classes and selection code at tiny shapes."""
    tiny = AttentionShape("dry", 4, 2, 64, sliding_window=16, soft_cap=30.0, sinks=True)
    step = Step("dry", 12, 4, 64)
    moe = MoeShape("dry", 4, 2, 32, 16)
    attention = [
        KernelCase(kernel, tiny, "bfloat16", 16, step, _choose(kernel, tiny, "bfloat16", 16, step))
        for kernel in ("mosaic", "triton")
    ]
    matmul = MatmulCase("grouped_matmul", moe, "gate_up", 32, 32, "float32", step, gmm.choose_config(24, 4, 32, 32, 4))
    q4 = quant_configs.FORMATS[3]  # zero points and act-order: every branch of the kernel
    packed = PackedCase("packed_matmul", q4, "dry", 5, 256, 48, "float32", "dry", pmm.choose_config(5, 256, 48, 4))
    fp8 = Fp8Case("fp8", True, "dry", 5, 64, 48, "dry")  # the W8A8 path: XLA's CPU runs the fp8 dot too
    return (*attention, matmul, packed, fp8)


# ------------------------------------------------------------------ step programs

QWEN3_MOE_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# the models whose step programs are compiled, at the device run's engine settings (gpu_check.engine_settings)
STEP_MODELS = {"llama3-8b": LLAMA31_8B, "qwen3-moe-30b-a3b": QWEN3_MOE_30B_A3B}
# and quantized at load by these methods (the device run's `quant` section), at their smallest and largest step
QUANT_STEPS = {"llama3-8b": ("int4", "fp8")}
