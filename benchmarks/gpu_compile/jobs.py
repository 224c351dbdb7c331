"""The compile check's two kinds of job, each run in a compiling process (`worker`): one kernel case compiled alone
for a target, with its ptxas report and verdict against the kernel's budget; one step program of the engine
compiled for a target, with its compile time, memory analysis and the Pallas kernels inside it."""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback
import warnings

from benchmarks.gpu_compile import capture
from benchmarks.gpu_compile.capture import DUMPED_MODULE
from netra_jax.targets import GPU_TARGETS, compile_device

# the kernels' names in the compiled programs (ptxas' entry functions) and the module holding each one's budget
KERNELS = {
    "mosaic": ("ragged_paged_attention_mgpu", "netra_jax.ops.paged_attention_mosaic"),
    "triton": ("ragged_paged_attention_m", "netra_jax.ops.paged_attention_triton"),
    "grouped_matmul": ("grouped_matmul_m", "netra_jax.ops.grouped_matmul_triton"),
    "packed_matmul": ("packed_matmul_w", "netra_jax.ops.packed_matmul_triton"),
}
# products XLA compiles itself (no Pallas kernel, no budget): judged by their compiled HLO (`judge_gemm`)
XLA_PRODUCTS = ("fp8",)
PALLAS_PREFIXES = tuple(prefix for prefix, _ in KERNELS.values())
# models whose smallest (decode) and largest (prefill) step also compile with LoRA slots (max_loras, max_lora_rank):
# every token's adapter delta on the segment matmul (`ops.lora_segment`, the grouped-matmul kernel) on GPU backends
LORA_STEPS = {"llama3-8b": (4, 64)}


def budget(kernel: str):
    import importlib

    return importlib.import_module(KERNELS[kernel][1]).GPU_BUDGET


def _error(e: BaseException, text: str) -> str:
    msg = f"{type(e).__name__}: {str(e)[:1200]}"
    detail = capture.errors_in(text)
    return f"{msg}\n{detail}" if detail and detail not in msg else msg


def _asdict(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


def compile_kernel(target: str, case, dump_dir: str) -> dict:
    """Compile `case` (a gpu_check.configs.KernelCase or MatmulCase) for `target` and judge its report against its
    kernel's budget and the target's shared memory. The result's "problems" lists what fails the check (empty: it
    passes)."""
    import jax

    dev = compile_device(target)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    fn = case.function()

    def kernel_case(*args):  # the module name selects the program's dump (the thunk sequence)
        return fn(*args)

    assert kernel_case.__name__ == DUMPED_MODULE
    row = {"case": case.name, "kernel": case.kernel, "dtype": case.dtype, "config": _asdict(case.config)}
    row |= case.describe()
    before = capture.dumped(dump_dir)
    t0 = time.perf_counter()
    with capture.captured() as out, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
        try:
            with jax.default_device(dev):  # Pallas' Triton lowering looks for a GPU among the default devices
                lowered = jax.jit(kernel_case).lower(*case.abstract_args(sharding))
                t1 = time.perf_counter()
                compiled = lowered.compile()
            failure = None
        except Exception as e:  # a compile error is this case's result
            failure = e
    if failure is not None:
        row["problems"] = [f"does not compile: {_error(failure, out.text)}"]
        return row
    row["lower_s"], row["compile_s"] = round(t1 - t0, 2), round(time.perf_counter() - t1, 2)
    if case.kernel in XLA_PRODUCTS:
        return row | judge_gemm(case, compiled)
    prefix = KERNELS[case.kernel][0]
    reports = [k for k in capture.ptxas_reports(out.text) if k.name.startswith(prefix)]
    if case.kernel == "mosaic":
        for rep, smem in zip(reports, capture.mosaic_smem(out.text), strict=False):
            rep.dynamic_smem = smem
    else:
        launched = capture.thunk_smem(dump_dir, before)
        for rep in reports:
            rep.dynamic_smem = launched.get(rep.name)
    if len(reports) != 1:
        row["problems"] = [f"expected one ptxas report of a {prefix}* kernel, found {len(reports)}"]
        return row
    rep = reports[0]
    row |= rep.as_dict()
    limit = budget(case.kernel)
    problems = limit.violations(rep.registers, rep.spill_bytes, rep.smem_bytes)
    smem_cap = GPU_TARGETS[target].smem_per_block
    if rep.smem_bytes is not None and rep.smem_bytes > smem_cap:
        problems.append(f"{rep.smem_bytes} bytes of shared memory > the target's {smem_cap}")
    row["budget"] = dataclasses.asdict(limit)
    row["problems"] = problems
    return row


def judge_gemm(case, compiled) -> dict:
    """An fp8-weight product (gpu_check.quant_configs.Fp8Case) as XLA compiled it: its GEMMs' operand types and the
    buffers it writes. It fails when the weight is copied into a buffer of its own outside the GEMM (widened or
    transposed: every call would write and re-read it), except on GPUs without fp8 (the W8A16 fallback, where XLA
    widens it: reported), and, where fp8 is native, when no GEMM multiplies in fp8 at a step of 16 rows or more (one
    decode row is a matrix-vector product, run on its fp8 loads widened in registers)."""
    import math

    hlo = compiled.as_text()
    gemms = [list(g) for g in capture.gemms(hlo)]
    buffers = capture.entry_buffers(hlo)
    copies = [f"{name} {dtype}{list(dims)}" for name, dtype, dims, _ in buffers if math.prod(dims) == case.k * case.n]
    fp8 = [g for g in gemms if g[1] == g[2] == "f8e4m3fn"]
    row = {"gemms": gemms, "weight_copies": copies, "fp8_gemm": fp8[0][0] if fp8 else None, "problems": []}
    row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    if case.native:
        if copies:
            row["problems"].append(f"the fp8 weight is copied outside the GEMM: {copies}")
        if case.m >= 16 and not fp8:
            row["problems"].append(f"no GEMM multiplies in fp8: {gemms}")
    return row


# ------------------------------------------------------------------ step programs


@functools.cache
def step_runner(
    target: str,
    model: str,
    depth: int | None = None,
    quantization: str | None = None,
    lora: tuple[int, int] | None = None,
):
    """The engine's runner for `model` (gpu_check.configs.STEP_MODELS) at the device run's engine settings, built
    for `target`'s compile-only device: abstract bf16 weights (the dummy loader's layout), nothing allocated, the
    attention and matmul backends "auto" resolves to on that target. depth: keep the model's first `depth` layers
    only (every layer is the same program, so its kernels and its temporaries are the full model's; the compile is
    shorter). quantization: the weights quantized at load by that method (abstract too) and laid out for the matmul
    backend, as the engine does. lora: (max_loras, max_lora_rank): the runner holds adapter slots (abstract, in the
    weights' dtype) as an engine with enable_lora does."""
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu_check import configs, engine_settings
    from netra_jax.config import ModelConfig
    from netra_jax.engine.aot import target_options
    from netra_jax.engine.runner import ModelRunner
    from netra_jax.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
    from netra_jax.loader import dummy
    from netra_jax.quant import quantize_params, weight_layout

    s = engine_settings.settings(False)
    hf = configs.STEP_MODELS[model]
    cfg = ModelConfig.from_hf_dict(hf if depth is None else hf | {"num_hidden_layers": depth})
    config = EngineConfig(
        dtype=s["dtype"],
        cache=CacheConfig(page_size=s["page_size"], num_pages=engine_settings.COMPILE_CHECK_PAGES),
        scheduler=SchedulerConfig(max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"]),
        max_model_len=s["max_model_len"],
        attention_backend=s["attention_backend"],
        async_scheduling=s["async_scheduling"],
        load_format="dummy",
        warmup=True,
    )
    dtype = jnp.dtype(config.dtype)
    opts = target_options(config, cfg, dtype, dtype, target)  # the backends "auto" resolves to on the target
    params = dummy.param_layout(cfg, dtype, optional=dummy.attention_biases(cfg, hf))
    if quantization:
        layout = functools.partial(weight_layout, backend=opts["matmul_backend"])
        params = jax.eval_shape(lambda p: layout(quantize_params(p, quantization)), params)
    if lora is not None:
        opts["lora"] = LoRAConfig(max_loras=lora[0], max_lora_rank=lora[1])
    runner = ModelRunner(cfg, params, num_pages=config.cache.num_pages, compile_for=compile_device(target), **opts)
    runner.set_prompt_logprob_buckets(fine=False)  # what LLMEngine.warmup compiles
    return runner


def step_shapes(target: str, model: str) -> list:
    """The step variants the engine's warm-up compiles (ModelRunner.all_shapes), smallest first."""
    return step_runner(target, model).all_shapes()


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def sizing(target: str, runner) -> dict:
    """What the engine's memory sizing assumes on `target` for this model at the default gpu_memory_utilization: the
    engine sizes jax's allocator to that share of the device (`netra_jax.engine.runner.claim_gpu_memory`), the
    weights go in, the KV cache gets `kv_budget` of the rest and the margin left is the activations', which every
    step's temporaries must fit in."""
    from netra_jax.engine.runner import kv_budget
    from netra_jax.engine_config import CacheConfig

    utilization = CacheConfig().gpu_memory_utilization
    usable = int(GPU_TARGETS[target].device_memory * utilization)
    weights = _nbytes(runner.params)
    budget = kv_budget(usable, weights)
    return {
        "usable_bytes": usable,
        "gpu_memory_utilization": utilization,
        "weight_bytes": weights,
        "kv_bytes": _nbytes(runner.kv),
        "kv_budget_bytes": budget,
        "activation_margin_bytes": usable - weights - budget,
    }


def compile_step(
    target: str,
    model: str,
    index: int,
    depth: int | None = None,
    quantization: str | None = None,
    lora: tuple[int, int] | None = None,
    *,
    dump_dir: str | None = None,
) -> dict:
    """Compile step variant `index` of `step_shapes` for `target` (with `depth` layers and weights quantized by
    `quantization`, and with `lora` adapter slots: see `step_runner`): compile time, memory analysis against the
    full model's sizing, the Pallas kernels ptxas compiled in it, any kernel that spills, the matmul backend with its
    GEMMs' operand types, and (from its thunk sequence dumped to `dump_dir`) what one step launches and whether a
    CUDA graph captures it (`capture.step_anatomy`)."""
    import jax

    from netra_jax.engine.aot import DEVICELESS_OPTIONS
    from netra_jax.quant import GPU_BACKENDS

    runner = step_runner(target, model, depth, quantization, lora)
    shape = step_shapes(target, model)[index]
    name = f"{model}+{quantization}" if quantization else model
    if lora is not None:
        name += "+lora"
    row = {"model": name, "num_tokens": shape.num_tokens, "num_seqs": shape.num_seqs, "backend": runner.backend}
    if lora is not None:
        row["lora"] = {"max_loras": lora[0], "max_lora_rank": lora[1]}
    row["matmul_backend"] = runner.matmul_backend
    row["layers"] = runner.cfg.num_layers
    row |= {"prompt_rows": shape.prompt_rows, "logit_rows": shape.num_rows}
    before = capture.dumped(dump_dir) if dump_dir else set()
    t0 = time.perf_counter()
    with capture.captured() as out, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
        try:
            with jax.default_device(runner.compile_for):
                lowered = runner.lower_step(shape, lora=lora is not None)
                t1 = time.perf_counter()
                compiled = lowered.compile(DEVICELESS_OPTIONS)  # as `netra-jax compile` builds it without the GPU
            failure = None
        except Exception as e:
            failure = e
    if failure is not None:
        row["problems"] = [f"does not compile: {_error(failure, out.text)}"]
        return row
    row["lower_s"], row["compile_s"] = round(t1 - t0, 2), round(time.perf_counter() - t1, 2)
    thunks = capture.step_thunks(dump_dir, before) if dump_dir else None
    if thunks is not None:
        row["anatomy"] = capture.step_anatomy(thunks, runner.cfg.num_layers)
    mem = compiled.memory_analysis()
    row["memory"] = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }
    row["sizing"] = sizing(target, step_runner(target, model, None, quantization))  # the full model's weights, KV
    if row["memory"]["temp_bytes"] > row["sizing"]["activation_margin_bytes"]:
        row.setdefault("problems", []).append(
            f"temporaries of {row['memory']['temp_bytes'] / 2**30:.2f} GiB exceed the memory sizing's activation "
            f"margin of {row['sizing']['activation_margin_bytes'] / 2**30:.2f} GiB"
        )
    if row["memory"]["alias_bytes"] < _nbytes(runner.kv):
        row.setdefault("problems", []).append("the KV cache is not updated in place (its buffers are not donated)")
    reports = capture.ptxas_reports(out.text)
    row["pallas_kernels"] = sorted({k.name for k in reports if k.name.startswith(PALLAS_PREFIXES)})
    row["spilling_kernels"] = sorted({f"{k.name} ({k.spill_bytes} B)" for k in reports if k.spill_bytes})
    hlo = compiled.as_text()
    if quantization:  # which GEMMs the quantized weights reached (fp8 operands: W8A8)
        row["gemm_operands"] = sorted({f"{a} x {b}" for _, a, b in capture.gemms(hlo)})
    row["misaligned_operands"] = capture.misaligned_kernel_operands(hlo)
    row["problems"] = row.get("problems", []) + [
        f"a Mosaic GPU kernel would refuse its buffer at run time: {m}" for m in row["misaligned_operands"]
    ]
    spills = [f"a Pallas kernel spills: {k}" for k in row["spilling_kernels"] if k.startswith(PALLAS_PREFIXES)]
    row["problems"] = row.get("problems", []) + spills
    if lora is not None and runner.matmul_backend in GPU_BACKENDS:  # the deltas on the segment matmul kernel
        if not any(k.startswith(KERNELS["grouped_matmul"][0]) for k in row["pallas_kernels"]):
            row["problems"].append("the LoRA deltas are not on the grouped-matmul kernel (ops.lora_segment)")
    del compiled, lowered
    return row


def run_job(job: tuple, dump_dir: str) -> dict:
    """One job: ("kernel", target, case index), ("broken", target, index of a `selftest.broken_cases` case) or
    ("step", target, model, shape index, depth[, quantization[, lora]]); an unexpected failure is the job's
    result."""
    from benchmarks.gpu_check import configs
    from benchmarks.gpu_compile import selftest

    kind, target, *rest = job
    t0 = time.perf_counter()
    extra = {"expected": selftest.broken_cases()[rest[0]][2]} if kind == "broken" else {}
    try:
        if kind == "kernel":
            row = compile_kernel(target, configs.kernel_cases(target)[rest[0]], dump_dir)
        elif kind == "broken":
            row = compile_kernel(target, selftest.broken_cases()[rest[0]][1], dump_dir)
        else:
            row = compile_step(target, *rest, dump_dir=dump_dir)
    except Exception:
        row = {"problems": [f"the check failed: {traceback.format_exc()[-1500:]}"]}
    row |= extra
    row["job"] = list(job)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row
