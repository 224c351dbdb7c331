"""The GPU compile check (benchmarks/gpu_compile): its parsers of the compilers' reports and its configuration list
(gpu_check/configs.py) on their own; then, where the CUDA wheels are installed (`make gpu-compile-setup`, as CI
does), the check itself: every kernel configuration and every step program compiled for the H200 and A100 targets
without a GPU, none spilling, over budget or short of memory, and deliberately broken kernels failing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import configs
from benchmarks.gpu_compile import capture
from netra_jax.engine.buckets import token_buckets
from netra_jax.ops.gpu_budget import GpuBudget

REPO = Path(__file__).resolve().parents[2]

CUDA_SITE = Path(os.environ.get("NETRA_JAX_CUDA_SITE") or REPO / ".venv" / "cuda13").resolve()
HAVE_CUDA = (CUDA_SITE / "jax_plugins" / "xla_cuda13").is_dir()
needs_cuda = pytest.mark.skipif(
    not HAVE_CUDA,
    reason=f"the CUDA 13 wheels are not installed in {CUDA_SITE} (`make gpu-compile-setup`; CI installs them)",
)

PTXAS = """\
I1202 18:51:17.558984    7890 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'ragged_paged_attention_mgpu_r8_t64_st2_s1_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for ragged_paged_attention_mgpu_r8_t64_st2_s1_mosaic_gpu_kernel
    272 bytes stack frame, 488 bytes spill stores, 388 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 272 bytes cumulative stack size, 1 bytes smem
Resources(smem_scratch_bytes=175104, tmem_scratch_cols=0, barrier_counts=Counter())
ptxas info    : Compiling entry function 'ragged_paged_attention_mgpu_r8_t64_st2_s1_mosaic_gpu_kernel' for 'sm_90a'
    272 bytes stack frame, 488 bytes spill stores, 388 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 272 bytes cumulative stack size, 1 bytes smem
I1202 18:41:49.190175    6243 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'input_reduce_fusion' for 'sm_80'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 368 bytes cmem[0]
"""
THUNKS = (  # the launch lines of XLA's thunk-sequence dump
    "004: kCustomKernel [prev=003 (1) | next=005 (1)] loop_add_clamp_fusion grid: [3, 1, 1] threads: [128, 1, 1]  "
    "shared_memory: 0 bytes\n"
    "005: kCustomKernel [prev=004 (1) | next=006 (1)] ragged_paged_attention_m16_t32_s1 grid: [288, 4, 1] "
    "threads: [128, 1, 1]  shared_memory: 42112 bytes\n"
)


def test_ptxas_reports_are_parsed_once_per_kernel():
    """XLA's log of a ptxas call and Mosaic's own print of it are one kernel; spills, registers and static shared
    memory come from the lines after its entry."""
    reports = capture.ptxas_reports(PTXAS)
    assert [r.name for r in reports] == [
        "ragged_paged_attention_mgpu_r8_t64_st2_s1_mosaic_gpu_kernel",
        "input_reduce_fusion",
    ]
    mosaic, fusion = reports
    assert (mosaic.registers, mosaic.spill_bytes, mosaic.static_smem, mosaic.arch) == (255, 876, 1, "sm_90a")
    assert (fusion.registers, fusion.spill_bytes, fusion.arch) == (32, 0, "sm_80")
    assert capture.mosaic_smem(PTXAS) == [175104]
    mosaic.dynamic_smem = 175104
    assert mosaic.as_dict()["smem_bytes"] == 175105 and fusion.smem_bytes is None


STEP_THUNKS = """\
000: kCommandBuffer [source | sink]
    001: kCustomKernel       [source       | next=002 (1)] input_reduce_fusion_8 grid: [1, 1, 1] threads: [256, 1, 1]
    002: kCustomKernel       [prev=001 (1) | next=003 (1)] gemm_fusion_dot_24 grid: [2048, 1, 1] threads: [64, 1, 1]
    003: kDynamicSliceFusion [prev=002 (1) | next=005 (1)] params=7, results=2
        004: kCustomCall [source | sink] kCustomCall
    005: kCustomKernel       [prev=003 (1) | sink] loop_add_fusion grid: [64, 1, 1] threads: [128, 1, 1]
006: kCustomKernel [prev=000 (1) | sink] loop_select_fusion grid: [1, 1, 1] threads: [128, 1, 1]
"""


def test_step_anatomy_counts_launches_and_what_a_cuda_graph_captures(tmp_path):
    a = capture.step_anatomy(STEP_THUNKS, layers=2)
    assert a["launches"] == 5 and a["launches_per_layer"] == 2.5
    assert a["launch_kinds"] == {"kCustomKernel": 4, "kCustomCall": 1}
    assert a["command_buffers"] == 1 and a["captured_launches"] == 4
    assert a["host_launches"] == 2 and not a["graph_captured"]  # the last kernel runs outside the graph
    inside = capture.step_anatomy(STEP_THUNKS.rsplit("006:", 1)[0], layers=2)
    assert inside["graph_captured"] and inside["host_launches"] == 1
    (tmp_path / "module_0001.jit__step.thunk_sequence_after_thunk_passes.txt").write_text(STEP_THUNKS)
    assert capture.step_thunks(tmp_path, set()) == STEP_THUNKS
    assert capture.step_thunks(tmp_path, capture.dumped(tmp_path)) is None  # only what a compile dumped since


def test_thunk_sequence_gives_dynamic_shared_memory(tmp_path):
    (tmp_path / "module_0001.jit_kernel_case.thunk_sequence.txt").write_text(THUNKS)
    before = capture.dumped(tmp_path)
    assert capture.thunk_smem(tmp_path, set()) == {
        "loop_add_clamp_fusion": 0,
        "ragged_paged_attention_m16_t32_s1": 42112,
    }
    assert capture.thunk_smem(tmp_path, before) == {}  # only what a compile dumped since


HLO = """\
%gemm_fusion_dot_computation (p0: f8e4m3fn[256,4096], p1: f8e4m3fn[4096,1024]) -> f32[256,1024] {
  %p0 = f8e4m3fn[256,4096]{1,0} parameter(0)
  %p1 = f8e4m3fn[4096,1024]{1,0} parameter(1)
  ROOT %dot.1 = f32[256,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.4 (x.1: bf16[256,4096], q.1: f8e4m3fn[4096,1024]) -> f32[256,1024] {
  %x.1 = bf16[256,4096]{1,0} parameter(0)
  %q.1 = f8e4m3fn[4096,1024]{1,0} parameter(1)
  %bitcast.2 = f8e4m3fn[1024,4096]{0,1} bitcast(%q.1)
  %loop_convert_fusion = f8e4m3fn[256,4096]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_convert
  %transpose.3 = f8e4m3fn[1024,4096]{1,0} transpose(%q.1), dimensions={1,0}
  %cublas-gemm.1 = (f32[256,1024]{1,0}, s8[4194304]{0}) custom-call(%loop_convert_fusion, %transpose.3), \
custom_call_target="__cublas$lt$matmul$f8"
  ROOT %gemm_fusion_dot.1 = f32[256,1024]{1,0} fusion(%loop_convert_fusion, %q.1), kind=kCustom
}
"""


def test_hlo_gemms_and_entry_buffers_are_parsed():
    """The fp8 products' judge reads the GEMMs' operand types (a dot in a fusion, a cuBLAS call) and the buffers
    the entry computation writes (a transposed weight here; parameters and bitcasts write none)."""
    assert capture.gemms(HLO) == [
        ("dot", "f8e4m3fn", "f8e4m3fn"),
        ("cublas:__cublas$lt$matmul$f8", "f8e4m3fn", "f8e4m3fn"),
    ]
    assert capture.entry_buffers(HLO) == [
        ("loop_convert_fusion", "f8e4m3fn", (256, 4096), "fusion"),
        ("transpose.3", "f8e4m3fn", (1024, 4096), "transpose"),
        ("gemm_fusion_dot.1", "f32", (256, 1024), "fusion"),
    ]


def _kernel_fusion(block_tables: str) -> str:
    """A compiled step's dynamic-slice fusion around the Mosaic attention call (its module text cut out), the block
    tables taken from the packed step array by `block_tables` (a slice or dynamic-slice instruction)."""
    return f"""\
%dynamic-slice-fusion (p0: s32[1024], p1: s32[1], p2: bf16[8192,16,8,128], p3: s32[4,8,2]) -> f32[8,1,8,8] {{
  %p0 = s32[1024]{{0}} parameter(0)
  %p1 = s32[1]{{0}} parameter(1)
  %p3 = s32[4,8,2]{{2,1,0}} parameter(3)
  {block_tables}
  %bitcast.138 = s32[1,128]{{1,0}} bitcast(%slice.75), metadata={{op_name="jit(_step)/slice"}}
  %p2 = bf16[8192,16,8,128]{{3,2,1,0}} parameter(2)
  ROOT %mpmd_map.6 = f32[8,1,8,8]{{3,2,1,0}} custom-call(%p1, %bitcast.138, /*index=2*/%p2), \
custom_call_target="mosaic_gpu_v2", metadata={{op_name="jit(_step)/ragged_paged_attention_mgpu_r8/mpmd_map"}}
}}
"""


def test_mosaic_operands_sliced_off_alignment_are_found():
    """XLA hands a Mosaic GPU call a slice of a larger buffer as an address inside it; the kernel refuses one that
    is not 256-byte aligned when it runs (the H200 failure: block tables at element 8 of the packed step array)."""
    bad = _kernel_fusion("%slice.75 = s32[128]{0} slice(%p0), slice={[8:136]}")
    assert capture.misaligned_kernel_operands(bad) == [
        "ragged_paged_attention_mgpu_r8 operand 1: a slice of %p0 at byte offset 32"
    ]
    assert (
        capture.misaligned_kernel_operands(_kernel_fusion("%slice.75 = s32[128]{0} slice(%p0), slice={[448:576]}"))
        == []
    )
    # a 3-d slice: its start corner's offset counts every dimension's stride (row 1 of [4, 8, 2]: 16 int32 = 64 B)
    corner = "%slice.75 = s32[1,8,2]{2,1,0} slice(%p3), slice={[1:2], [0:8], [0:2]}"
    assert capture.misaligned_kernel_operands(_kernel_fusion(corner)) == [
        "ragged_paged_attention_mgpu_r8 operand 1: a slice of %p3 at byte offset 64"
    ]
    # a slice at a run-time offset along a dimension whose stride is 4 bytes may land anywhere
    dyn = "%slice.75 = s32[128]{0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={128}"
    assert capture.misaligned_kernel_operands(_kernel_fusion(dyn)) == [
        "ragged_paged_attention_mgpu_r8 operand 1: a dynamic slice of %p0 along dimension(s) [0]"
    ]
    assert capture.misaligned_kernel_operands(HLO) == []  # no Mosaic call there


def test_budget_violations():
    b = GpuBudget(registers=200, smem_bytes=1000)
    assert b.violations(200, 0, 1000) == []
    assert b.violations(201, 4, 1001) == [
        "201 registers > budget 200",
        "4 bytes of register spills > budget 0",
        "1001 bytes of shared memory > budget 1000",
    ]
    assert b.violations(None, 0, None) == ["no register count reported", "no shared-memory size reported"]


def _every_step():
    """Every step shape the device run's engine settings reach (a token bucket, its sequences), plus the lone decode
    over a long context."""
    s = configs.engine_settings.settings(False)
    for t in token_buckets(s["max_num_batched_tokens"]):
        yield configs.Step(f"bucket_{t}", t, min(t, s["max_num_seqs"]), s["max_model_len"])
    yield configs.step("decode_1")


@pytest.mark.parametrize("target", ["h200", "a100"])
def test_the_list_covers_every_configuration_the_selection_code_returns(target):
    """The three steps of the list stand for every warm-up bucket: what the selection code returns at any bucket,
    for any listed shape and page size, is a kernel body (key) of the list, and no two cases of the list share one."""
    cases = configs.kernel_cases(target)
    keys = {c.key for c in cases}
    assert len(keys) == len(cases)
    for kernel in configs.TARGET_KERNELS[target]:
        if kernel in ("grouped_matmul", "packed_matmul", "fp8"):
            continue
        for shape, dtype, page in configs._candidates(kernel):
            if configs._supported(kernel, shape, dtype, page):
                for st in _every_step():
                    case = configs.KernelCase(
                        kernel, shape, dtype, page, st, configs._choose(kernel, shape, dtype, page, st)
                    )
                    assert case.key in keys, case.name
    assert {c.kernel for c in cases} == set(configs.TARGET_KERNELS[target])
    # the fallback takes every head width, on every target
    assert {c.shape.head_dim for c in cases if c.kernel == "triton"} == {s.head_dim for s in configs.SHAPES}


def test_the_list_spans_what_the_kernels_branch_on():
    """Head widths, GQA groups, windows, soft-caps, sinks, page sizes and both dtypes; head_dim 256 on Mosaic with P
    in registers, narrower heads without; the step programs' models among the shapes."""
    h200 = configs.kernel_cases("h200")
    attention = [c for c in h200 if c.kernel in ("mosaic", "triton")]
    assert {c.shape.head_dim for c in attention} == {64, 80, 96, 128, 256}
    assert {c.shape.group for c in attention} >= {1, 2, 3, 4, 7, 8, 16}
    mosaic = [c for c in attention if c.kernel == "mosaic"]
    assert {c.page_size for c in mosaic} == {16, 32, 64, 128, 256}
    assert all(c.config.p_in_registers == (c.shape.head_dim > 128) for c in mosaic)
    assert {(c.shape.sliding_window is not None, c.shape.soft_cap is not None, c.shape.sinks) for c in attention} >= {
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, False, True),
        (False, True, False),
    }
    assert {c.dtype for c in attention if c.kernel == "triton"} == {"bfloat16", "float32"}
    assert {(c.config.num_splits > 1, c.config.block_rows) for c in mosaic} >= {(True, 8), (False, 8), (False, 64)}
    gmm = [c for c in h200 if c.kernel == "grouped_matmul"]
    assert {c.config.block_m for c in gmm} == {16, 32, 64} and {c.dtype for c in gmm} == {"bfloat16", "float32"}
    for model in configs.STEP_MODELS.values():
        heads = (model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"])
        assert heads in {(s.q_heads, s.kv_heads, s.head_dim) for s in configs.SHAPES}


def _run(args: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CUDA_SITE), str(REPO)]), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "benchmarks.gpu_compile", *args, "--out", str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.fixture(scope="module")
def compile_check(tmp_path_factory):
    """The whole check as CI runs it: the H100 (the H200 compiles the same kernels, and has more memory) and the
    A100, every kernel case, every step variant with 2 layers."""
    tmp = tmp_path_factory.mktemp("gpu_compile")
    r = _run(["--targets", "h100,a100", "--depth", "2", "--workers", str(os.cpu_count() or 1)], tmp, timeout=1500)
    results = {p.name.split("-gpu_compile-")[1][:-5]: json.loads(p.read_text()) for p in tmp.glob("*.json")}
    return r, results


@needs_cuda
@pytest.mark.slow
def test_every_kernel_configuration_compiles_within_its_budget(compile_check):
    r, results = compile_check
    assert set(results) == {"h100", "a100"}, r.stdout[-3000:] + r.stderr[-3000:]
    for target, res in results.items():
        kernels = res["kernels"]
        assert len(kernels) == len(configs.kernel_cases(target))
        failed = [f"{k['case']}: {k['problems']}" for k in kernels if k["problems"]]
        assert not failed, failed
        for k in kernels:
            if k["kernel"] == "fp8":  # XLA's own GEMMs: judged by their HLO (test_fp8_weights_...)
                continue
            assert k["registers"] > 0 and k["spill_bytes"] == 0 and 0 < k["smem_bytes"] <= k["budget"]["smem_bytes"]
        assert (Path(r.args[-1]) / f"{res['date'][:10]}-gpu_compile-{target}.md").is_file()


@needs_cuda
@pytest.mark.slow
def test_fp8_weights_multiply_in_fp8_on_hopper_and_are_never_copied_there(compile_check):
    """H100: every fp8 product of 16 rows or more is a GEMM over fp8 operands (XLA's Triton GEMM or cuBLASLt's fp8
    call) and no product copies the weight; A100: the W8A16 fallback compiles (XLA widens the weight there)."""
    _, results = compile_check
    for target, res in results.items():
        fp8 = [k for k in res["kernels"] if k["kernel"] == "fp8"]
        assert len(fp8) == len(configs.fp8_cases(target))
        for k in fp8:
            assert not k["problems"], k
            if target == "h100":
                assert not k["weight_copies"]
                assert k["fp8_gemm"] or k["step"] == "decode_1", k


@needs_cuda
@pytest.mark.slow
def test_every_step_program_fits_the_memory_sizing(compile_check):
    r, results = compile_check
    assert r.returncode == 0, r.stdout[-3000:]
    for target, res in results.items():
        steps = res["steps"]
        for model in configs.STEP_MODELS:
            mine = [s for s in steps if s["model"] == model]
            assert len(mine) >= 12 and len({(s["num_tokens"], s["prompt_rows"]) for s in mine}) == len(mine)
            assert min(s["num_tokens"] for s in mine) == 64  # GPU buckets start at 64 (engine/buckets.py)
            for s in mine:
                assert not s["problems"], (target, s)
                assert s["anatomy"]["launches"] > 0 and s["anatomy"]["host_launches"] >= 1
                assert s["memory"]["temp_bytes"] <= s["sizing"]["activation_margin_bytes"]
                kernels = s["pallas_kernels"]
                assert any(k.startswith("ragged_paged_attention") for k in kernels)
                if "moe" in model:  # the experts on the grouped-matmul kernel, not XLA's masked ragged dot
                    assert any(k.startswith("grouped_matmul") for k in kernels)
        for model, methods in configs.QUANT_STEPS.items():  # the quantized weights reach their GPU kernels
            for method in methods:
                mine = [s for s in steps if s["model"] == f"{model}+{method}"]
                assert len(mine) == 2 and all(not s["problems"] for s in mine), mine
                assert {s["matmul_backend"] for s in mine} == {"gpu" if target == "h100" else "gpu_sm80"}
                if method == "int4":
                    assert all(any(k.startswith("packed_matmul_w4") for k in s["pallas_kernels"]) for s in mine)
                elif target == "h100":  # W8A8 at the prefill step
                    assert "f8e4m3fn x f8e4m3fn" in max(mine, key=lambda s: s["num_tokens"])["gemm_operands"]
        backends = {s["backend"] for s in steps}
        assert backends == ({"mosaic"} if target == "h100" else {"triton"})
        # every step of the dense model, LoRA and quantized weights included, is one CUDA graph (a while loop in it,
        # e.g. jnp.searchsorted's default, would run from the host between two graphs)
        dense = [s for s in steps if s["model"].startswith("llama3-8b")]
        assert dense and all(s["anatomy"]["graph_captured"] for s in dense), [s["anatomy"] for s in dense]


@needs_cuda
@pytest.mark.slow
def test_broken_kernels_fail_the_check(tmp_path):
    """An oversized Triton block does not compile for the A100; the Mosaic kernel at head_dim 256 with P staged
    through shared memory spills: the check must fail both, each for its reason."""
    r = _run(["--self-test", "--workers", "2"], tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.count("caught:") == 2 and "MISSED" not in r.stdout
