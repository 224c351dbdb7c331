"""The GPU check's step profile (benchmarks/gpu_check/profile.py): a real `jax.profiler` trace of a jitted step and
its sampler run on this CPU is found and summarized consistently; a GPU-shaped trace laid out as jax writes it
(with and without xprof's derived XLA Modules line) gives the exact class times, idle time and kernels per step."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.gpu_check.profile import CLASSES, _find_trace, capture, classify, summarize

CALLS = 5


def _probe_step(x, w, *, scale):
    return jnp.tanh(x @ w) * scale + 1.0


def _probe_sample(x):
    return jnp.argmax(x, axis=-1)


def test_cpu_trace_of_a_jitted_step(tmp_path):
    # a partial, as the engine's runner jits its step: the module is still named after the function
    step = jax.jit(functools.partial(_probe_step, scale=2.0))
    sample = jax.jit(_probe_sample)
    x = jnp.ones((64, 64), jnp.float32)
    w = jnp.full((64, 64), 0.01, jnp.float32)
    sample(step(x, w)).block_until_ready()  # compiled before the trace

    def run():
        out = None
        for _ in range(CALLS):
            out = sample(step(x, w))
        return out

    path = capture(run, tmp_path / "trace")
    assert path.is_file() and path.name.endswith(".json.gz") and "plugins/profile" in path.as_posix()
    s = summarize(path, step_module_prefix="jit__probe_step")
    json.dumps(s)  # kept as JSON

    assert s["source"] == "cpu" and s["device"]["tracks"]
    assert s["step_modules"] == ["jit__probe_step"]
    assert s["steps"] == CALLS and s["steps_source"] == "run_id"
    assert s["kernels"] > 0 and s["kernels"] % CALLS == 0
    assert s["kernels_per_step"] == pytest.approx(s["kernels"] / CALLS)
    assert 0 < s["busy_us"] <= s["window_us"] + 1e-3
    assert s["idle_us"] == pytest.approx(s["window_us"] - s["busy_us"], abs=2e-3)
    assert 0 <= s["idle_fraction"] < 1
    assert s["device_us_per_step"] + s["idle_us_per_step"] == pytest.approx(s["wall_us_per_step"], abs=2e-3)
    assert set(s["classes"]) == set(CLASSES)
    assert sum(c["share"] for c in s["classes"].values()) == pytest.approx(1.0, abs=5e-3)
    assert sum(c["kernels"] for c in s["classes"].values()) == s["kernels"]
    # the sampler's program is told apart by its module, and runs once per step
    assert s["classes"]["sampler"]["us"] > 0 and s["classes"]["sampler"]["kernels"] % CALLS == 0
    assert s["modules"]["jit__probe_step"]["kernels"] + s["modules"]["jit__probe_sample"]["kernels"] == s["kernels"]
    # the host's launches of the step: one PjitFunction per call
    assert s["host_launch_source"] == "PjitFunction" and s["host_launches"] == CALLS
    assert s["host_us_per_step"] > 0 and s["host_launch_us"] > 0
    assert s["top_kernels"] and all(k["count"] % CALLS == 0 and k["us"] > 0 for k in s["top_kernels"])
    # the same trace, its number of steps given
    assert summarize(path, steps=10, step_module_prefix="jit__probe_step")["kernels_per_step"] == pytest.approx(
        s["kernels"] / 10
    )


def test_no_trace_written_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace JSON"):
        _find_trace(tmp_path)


# One decode step of the synthetic GPU trace, in us from the step's start: (stream, start, end, name, module).
# Steps start every PERIOD us; the device then idles from 75 us until the next step.
STEP = [
    (7, 0, 20, "nvjet_tst_128x64_64x8_2x1_v_bz_TNN", "jit__step"),  # gemm
    (7, 20, 35, "ragged_paged_attention_m64_t16_s1", "jit__step"),  # attention
    (7, 35, 40, "loop_add_rsqrt_fusion", "jit__step"),  # norm_elementwise
    (7, 40, 60, "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32", "jit__step"),  # gemm
    (13, 50, 55, "input_reduce_fusion", "jit__step"),  # norm_elementwise, on a second stream under the gemm
    (7, 60, 61, "cleanup_kernel", "jit__step"),  # other
    (7, 62, 70, "loop_select_fusion", "jit_sample_tokens"),  # sampler, by its module
    (7, 70, 72, "input_reduce_fusion_1", "jit_sample_tokens"),  # sampler
    (7, 74, 75, "MemcpyD2H", "jit_sample_tokens"),  # copy
]
PERIOD, T0, N = 100, 1000, 3
HOST, GPU = 701, 1
DERIVED = 3735928559  # xprof's derived lines (Steps, XLA Modules, XLA Ops) take ids from 0xdeadbeef


def _gpu_trace(tmp_path: Path, *, modules_line: bool, kernel_modules: bool, host: bool = True) -> Path:
    """A trace as jax writes it for one GPU: /host:CPU (pid 701) with the Python thread's PjitFunction calls and
    the runtime's "<module>:XLA GPU module" events; /device:GPU:0 (pid 1 + plane id) with one line per CUDA
    stream named "Stream #<id>(<activity kinds>)" holding CUPTI's kernel and copy events, whose args carry the
    annotation's hlo_module / hlo_op; optionally xprof's derived XLA Modules and XLA Ops lines."""
    meta = [
        {"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": HOST, "tid": 11, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": HOST, "tid": 12, "name": "thread_name", "args": {"name": "tf_pjrt_thread"}},
        {"ph": "M", "pid": GPU, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": GPU, "name": "process_sort_index", "args": {"sort_index": GPU}},
        {"ph": "M", "pid": GPU, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel,MemcpyD2H)"}},
        {"ph": "M", "pid": GPU, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Kernel)"}},
    ]
    if modules_line:
        meta += [
            {"ph": "M", "pid": GPU, "tid": DERIVED + 4, "name": "thread_name", "args": {"name": "XLA Modules"}},
            {"ph": "M", "pid": GPU, "tid": DERIVED + 5, "name": "thread_name", "args": {"name": "XLA Ops"}},
        ]
    events: list = []
    for i in range(N):
        t = T0 + i * PERIOD
        for k, (stream, start, end, name, module) in enumerate(STEP):
            args = {"correlation_id": str(100 * i + k), "hlo_op": f"fusion.{k}"}
            if kernel_modules:
                args["hlo_module"] = module
            events.append(
                {"ph": "X", "pid": GPU, "tid": stream, "ts": t + start, "dur": end - start, "name": name, "args": args}
            )
            if modules_line:  # one XLA Ops event per kernel: not kernels themselves
                events.append(
                    {
                        "ph": "X",
                        "pid": GPU,
                        "tid": DERIVED + 5,
                        "ts": t + start,
                        "dur": end - start,
                        "name": f"fusion.{k}",
                    }
                )
        if modules_line:
            events += [
                {"ph": "X", "pid": GPU, "tid": DERIVED + 4, "ts": t, "dur": 61, "name": "jit__step(12)"},
                {"ph": "X", "pid": GPU, "tid": DERIVED + 4, "ts": t + 62, "dur": 13, "name": "jit_sample_tokens(13)"},
            ]
        if host:
            h = t - 100
            events += [
                {"ph": "X", "pid": HOST, "tid": 11, "ts": h, "dur": 30, "name": "PjitFunction(_step)"},
                {"ph": "X", "pid": HOST, "tid": 11, "ts": h + 1, "dur": 28, "name": "PjitFunction(_step)"},  # nested
                {"ph": "X", "pid": HOST, "tid": 12, "ts": h + 5, "dur": 20, "name": "jit__step:XLA GPU module"},
                {"ph": "X", "pid": HOST, "tid": 11, "ts": h + 40, "dur": 10, "name": "PjitFunction(sample_tokens)"},
            ]
    # shapes to skip: a counter, an event with a bad timestamp, one without a name, the exporter's trailing {}
    events += [
        {"ph": "C", "pid": GPU, "ts": T0, "name": "power_mw", "args": {"power_mw": 1.0}},
        {"ph": "X", "pid": GPU, "tid": 7, "ts": "soon", "dur": 1, "name": "broken"},
        {"ph": "X", "pid": GPU, "tid": 7, "ts": T0, "dur": 1},
        "not an event",
        {},
    ]
    path = tmp_path / "gpu.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "metadata": {"highres-ticks": True}, "traceEvents": meta + events}, f)
    return path


@pytest.mark.parametrize(
    "modules_line, kernel_modules, steps_source",
    [
        (False, True, "host_launches (PjitFunction)"),  # the trace.json.gz jax itself writes
        (True, False, "xla_modules_line"),  # modules only on xprof's derived line
        (True, True, "xla_modules_line"),
    ],
)
def test_gpu_trace(tmp_path, modules_line, kernel_modules, steps_source):
    s = summarize(_gpu_trace(tmp_path, modules_line=modules_line, kernel_modules=kernel_modules))
    assert s["source"] == "gpu"
    assert s["device"]["name"] == "/device:GPU:0" and s["device"]["pid"] == GPU
    assert s["device"]["tracks"] == ["Stream #13(Kernel)", "Stream #7(Kernel,MemcpyD2H)"]
    assert s["step_modules"] == ["jit__step"]
    us = {c: v["us"] for c, v in s["classes"].items()}
    assert us == {"gemm": 120, "attention": 45, "norm_elementwise": 30, "sampler": 30, "copy": 3, "other": 3}
    assert {c: v["kernels"] for c, v in s["classes"].items()} == {
        "gemm": 6,
        "attention": 3,
        "norm_elementwise": 6,
        "sampler": 6,
        "copy": 3,
        "other": 3,
    }
    assert s["classes"]["gemm"]["share"] == pytest.approx(120 / 231, abs=1e-3)
    assert s["kernels"] == 27 and s["steps"] == N and s["kernels_per_step"] == 9
    assert s["steps_source"] == steps_source
    # busy per step: [0, 61] + [62, 72] + [74, 75]; idle: 1 + 2 us inside each step, 25 us between steps
    assert s["busy_us"] == 3 * 72 and s["window_us"] == 2 * PERIOD + 75
    assert s["idle_us"] == 3 * 3 + 2 * 25 and s["idle_fraction"] == pytest.approx(59 / 275, abs=1e-3)
    assert s["device_us_per_step"] == 72 and s["idle_us_per_step"] == pytest.approx(59 / 3, abs=1e-3)
    assert s["host_us_per_step"] == PERIOD and s["host_launch_us"] == 30 and s["host_launches"] == N
    top = s["top_kernels"]  # by time, ties by name
    assert top[0] == {"name": "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32", "class": "gemm", "count": 3, "us": 60}
    assert [k["name"] for k in top[1:3]] == ["nvjet_tst_128x64_64x8_2x1_v_bz_TNN", "ragged_paged_attention_m64_t16_s1"]
    assert len(top) == 9 and sum(k["count"] for k in top) == 27
    assert s["modules"] == {"jit__step": {"kernels": 18, "us": 198}, "jit_sample_tokens": {"kernels": 9, "us": 33}}


def test_gpu_trace_steps_without_host_events(tmp_path):
    """Without host launches or a modules line the step program's kernel runs between the sampler's count."""
    path = _gpu_trace(tmp_path, modules_line=False, kernel_modules=True, host=False)
    s = summarize(path)
    assert (s["steps"], s["steps_source"], s["host_us_per_step"], s["host_launches"]) == (N, "kernel_runs", None, 0)
    given = summarize(path, steps=6)
    assert (given["steps"], given["steps_source"], given["steps_found"], given["kernels_per_step"]) == (
        6,
        "given",
        N,
        4.5,
    )
    # a prefix no module has: no sampler by module, every kernel classed by its name
    other = summarize(path, step_module_prefix="jit_prefill")
    assert other["step_modules"] == [] and other["steps"] is None and other["kernels_per_step"] is None
    assert other["classes"]["sampler"]["us"] == 0 and other["classes"]["norm_elementwise"]["us"] == 30 + 30


@pytest.mark.parametrize(
    "name, module, cls",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", "jit__step", "gemm"),
        ("gemvx_kernel", "jit__step", "gemm"),
        ("packed_matmul_w4_m16_n128_k256", "jit__step", "gemm"),
        ("gemm_fusion_dot_3", "jit__step", "gemm"),
        ("ragged_paged_attention_mgpu_r8_t16_st2_s1", "jit__step", "attention"),
        ("mosaic_gpu_kernel", "jit__step", "attention"),
        ("wrapped_convert", "jit__step", "norm_elementwise"),
        ("input_scatter_fusion", "jit__step", "norm_elementwise"),
        ("Memset", "jit__step", "copy"),
        ("MemcpyH2D", "jit_sample_tokens", "copy"),
        ("nvjet_tst_64x8", "jit_token_logprobs", "sampler"),  # any kernel of another program
        ("DeviceRadixSortOnesweepKernel", "jit__widen_ids", "sampler"),
        ("sample_tokens_fusion", None, "sampler"),  # module unknown: by name
        ("cleanup_kernel", None, "other"),
    ],
)
def test_classify(name, module, cls):
    assert classify(name, module, "jit__step", step_seen=True) == cls
