"""Compiled-program bundles (netra_jax/engine/aot.py, engine/bundle.py): `netra-jax compile` writes one engine
configuration's programs, `LLM(compiled=...)` loads them instead of compiling (greedy tokens still transformers'),
a bundle of another configuration, model or device, a damaged one, or a directory that is not one, is refused with
a line naming why, and a GPU target compiles here without a GPU.

The bundles are built by `netra-jax compile` in a subprocess: this process has jax's persistent compilation cache on
(conftest), whose executables do not re-serialize whole, so `compile_bundle` refuses to run here. The subprocess gets
$JAX_COMPILATION_CACHE_DIR pointing at an empty directory, which the command must ignore (and leave empty)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest
from support.checkpoints import FIXTURES, REPO, reference
from support.compiles import compiled_jits

from netra_jax import LLM, SamplingParams
from netra_jax.config import ConfigError
from netra_jax.engine import bundle
from netra_jax.engine.aot import compile_bundle
from netra_jax.engine_args import EngineArgs

MODEL = FIXTURES / "tiny-llama"
# two sequences of at most 128 tokens, steps of at most 64: 20 programs (8 steps, 2 widenings, 6 token programs,
# 4 logprob programs), about 15 s to compile on two cores
KW = dict(dtype="float32", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
FLAGS = ["--dtype", "float32", "--max-num-seqs", "2", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
PROGRAMS = {"_step", "_widen_ids", "sample_tokens", "token_logprobs"}  # the jitted functions a bundle holds
FACTORY_LOG = "netra_jax.engine.factory"  # where the one-line warning of a bundle not used goes

# jax's CUDA plugin, as tests/benchmarks/test_gpu_compile.py finds it (`make gpu-compile-setup`)
CUDA_SITE = Path(os.environ.get("NETRA_JAX_CUDA_SITE") or REPO / ".venv" / "cuda13").resolve()
HAVE_CUDA = (CUDA_SITE / "jax_plugins" / "xla_cuda13").is_dir()
needs_cuda = pytest.mark.skipif(
    not HAVE_CUDA,
    reason=f"the CUDA 13 wheels are not installed in {CUDA_SITE} (`make gpu-compile-setup`; CI installs them)",
)


def _compile(out: Path, flags: list[str], target: str = "cpu") -> str:
    """Run `netra-jax compile MODEL FLAGS --target TARGET -o OUT` in a fresh process; its stdout."""
    xla_cache = out.parent / f"{out.name}-xla-cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(xla_cache))
    if target != "cpu":
        env["PYTHONPATH"] = os.pathsep.join([str(CUDA_SITE), str(REPO)])
    cmd = [sys.executable, "-m", "netra_jax.cli", "compile", str(MODEL), *flags, "--target", target, "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert not xla_cache.exists() or not any(xla_cache.iterdir()), "compiled through the persistent cache"
    return proc.stdout


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory) -> tuple[Path, str]:
    """(a bundle of tiny-llama under KW for this host, what `netra-jax compile` printed)."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-llama-cpu"
    return out, _compile(out, FLAGS)


def _cases() -> list[dict]:
    return reference("tiny-llama")["cases"]


def _greedy(llm: LLM) -> list[list[int]]:
    """The greedy continuations of the fixture's prompts, as long as transformers' reference ones."""
    cases = _cases()
    params = SamplingParams(max_tokens=len(cases[0]["greedy_ids"]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _refused(caplog, bundle_dir: Path) -> list[str]:
    """The factory's warnings about `bundle_dir` (one line each)."""
    lines = [r.getMessage() for r in caplog.records if r.name == FACTORY_LOG and str(bundle_dir) in r.getMessage()]
    assert all("\n" not in line for line in lines)
    return lines


def test_bundle_layout(cpu_bundle):
    out, stdout = cpu_bundle
    manifest = bundle.read_manifest(out)
    programs = manifest["programs"]
    kinds = [p["kind"] for p in programs]
    assert {k: kinds.count(k) for k in set(kinds)} == {"step": 8, "widen": 2, "sampler": 6, "logprobs": 4}
    assert manifest["target"] == "cpu" and manifest["format"] == bundle.FORMAT
    sig = manifest["signature"]
    assert sig["platform"] == "cpu" and sig["jax"] == jax.__version__
    assert sig["device"] == bundle.device_name("cpu", jax.devices()[0].device_kind)
    runner = json.loads(sig["runner"])
    assert (runner["max_seqs_bucket"], runner["max_step_tokens"]) == (2, 64)
    for i, p in enumerate(programs):
        assert p["file"] == f"programs/{i:04d}-{p['kind']}.xz"
        assert (out / p["file"]).stat().st_size == p["bytes"] > 0
    assert sorted(f.name for f in (out / "programs").iterdir()) == sorted(Path(p["file"]).name for p in programs)
    assert f"{len(programs)} programs for cpu" in stdout and f"--compiled {out}" in stdout


def test_loaded_bundle_compiles_nothing_and_matches_transformers(cpu_bundle, caplog):
    out, _ = cpu_bundle
    n = len(bundle.read_manifest(out)["programs"])
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG), compiled_jits() as compiled:
        llm = LLM(MODEL, compiled=out, **KW)
        report = llm.engine.compiled_report
        tokens = _greedy(llm)
        # the sampled token program and the logprob program, and a step with prompt logprobs, all loaded too
        sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, logprobs=2, prompt_logprobs=1)
        (res,) = llm.generate([{"prompt_token_ids": _cases()[1]["prompt_ids"]}], sampled, use_tqdm=False)
    assert report.mismatch is None and report.loaded == n == len(report.programs), report
    assert not _refused(caplog, out)
    assert tokens == [c["greedy_ids"] for c in _cases()]
    assert len(res.outputs[0].token_ids) == 6 and len(res.outputs[0].logprobs) == 6 and res.prompt_logprobs
    assert not PROGRAMS & set(compiled), f"compiled although loaded: {compiled}"


def test_server_started_from_a_bundle_compiles_nothing(cpu_bundle):
    """`netra-jax serve --compiled DIR` in a fresh process: every program loaded, none compiled at warm-up or on the
    request path, and the reference tokens."""
    from support.server import ServerProcess, scrape

    out, _ = cpu_bundle
    n = len(bundle.read_manifest(out)["programs"])
    server = ServerProcess(*FLAGS, "--compiled", str(out), model=str(MODEL)).wait_ready()
    try:
        assert f"loaded {n} compiled programs from {out}" in server.text()
        assert "(0 variants compiled)" in server.text(), server.text()[-2000:]
        before = scrape(server.url)["netra_xla_compilations_outside_warmup"]
        case = _cases()[0]
        body = {"model": "tiny-llama", "prompt": case["prompt_ids"], "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == case["greedy_ids"][:4]
        assert scrape(server.url)["netra_xla_compilations_outside_warmup"] == before
        assert scrape(server.url)["netra_programs_pending"] == 0
    finally:
        server.stop()


def test_mismatched_configuration_warns_and_compiles(cpu_bundle, caplog):
    """Another max_num_seqs changes every step and sampler program: the bundle is not used, one warning line names
    the runner options that differ, and the engine compiles as usual (the control of the test above: the compile
    probe sees these programs compile, persistent-cache hits included)."""
    out, _ = cpu_bundle
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        llm = LLM(MODEL, compiled=out, **{**KW, "max_num_seqs": 4})
    report = llm.engine.compiled_report
    assert report.loaded == 0 and not llm.engine.runner.programs
    assert report.mismatch.startswith("compiled for another configuration: ")
    assert "runner.max_seqs_bucket (bundle 2, this engine 4)" in report.mismatch
    (line,) = _refused(caplog, out)
    assert "not used, compiling instead" in line and report.mismatch in line
    with compiled_jits() as compiled:
        assert _greedy(llm) == [c["greedy_ids"] for c in _cases()]
    assert {"_step", "sample_tokens"} <= set(compiled)


def test_bundle_of_another_model_is_a_mismatch(cpu_bundle, caplog):
    out, _ = cpu_bundle
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        llm = LLM(FIXTURES / "tiny-qwen2", compiled=out, **KW)
    report = llm.engine.compiled_report
    assert report.loaded == 0 and not llm.engine.runner.programs
    assert "model (bundle " in report.mismatch and "params (bundle " in report.mismatch
    (line,) = _refused(caplog, out)
    assert "model (bundle " in line


def test_damaged_bundle_loads_nothing_and_compiles(cpu_bundle, tmp_path, caplog):
    out, _ = cpu_bundle
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    victim = bundle.read_manifest(damaged)["programs"][-1]["file"]  # the last: those before it load first
    (damaged / victim).write_bytes((damaged / victim).read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        llm = LLM(MODEL, compiled=damaged, **KW)
    report = llm.engine.compiled_report
    assert report.loaded == 0 and not report.programs and not llm.engine.runner.programs  # all or nothing
    assert report.mismatch.startswith(f"cannot load {victim}: ")
    assert len(_refused(caplog, damaged)) == 1
    assert _greedy(llm) == [c["greedy_ids"] for c in _cases()]


@pytest.mark.parametrize("content", [None, "{not json", '{"format": 999}'], ids=["empty", "garbled", "format"])
def test_not_a_bundle_is_an_error(tmp_path, content):
    if content is not None:
        (tmp_path / bundle.MANIFEST).write_text(content)
    with pytest.raises(ValueError) as e:
        LLM(MODEL, compiled=tmp_path, **KW)
    msg = str(e.value)
    assert str(tmp_path) in msg and "\n" not in msg
    if content is None:
        assert "is not a compiled bundle (no manifest.json; `netra-jax compile` writes one)" in msg
    elif content.startswith("{not"):
        assert msg.startswith("cannot read ")
    else:
        assert f"not a bundle of format {bundle.FORMAT}" in msg
    with pytest.raises(ValueError, match="is not a compiled bundle"):
        LLM(MODEL, compiled=tmp_path / "missing", **KW)


def test_differences_name_each_field_and_runner_option():
    runner = {"max_seqs_bucket": 2, "page_size": 16, "buckets": list(range(64))}
    a = {"platform": "cpu", "model": "m1", "runner": json.dumps(runner, sort_keys=True)}
    assert bundle.differences(a, dict(a)) == []
    b = {"platform": "gpu", "model": "m1", "runner": json.dumps({**runner, "max_seqs_bucket": 8}, sort_keys=True)}
    b["vocab_size"] = "512"
    assert bundle.differences(a, b) == [
        "platform (bundle cpu, this engine gpu)",
        "runner.max_seqs_bucket (bundle 2, this engine 8)",
        "vocab_size (bundle None, this engine 512)",
    ]
    # a runner field that is not a table of options is shown as it is, a long one as a digest
    (line,) = bundle.differences({"runner": "x" * 80}, {"runner": "y"})
    assert line.startswith("runner (bundle ") and line.endswith(", this engine y)") and "x" * 61 not in line


def test_compile_bundle_refuses_with_the_persistent_cache(tmp_path):
    assert jax.config.jax_compilation_cache_dir  # conftest's cache
    config = EngineArgs(model=str(MODEL), **KW).create_engine_config()
    with pytest.raises(ConfigError, match="persistent compilation cache"):
        compile_bundle(config, "cpu", tmp_path / "out")
    with pytest.raises(ConfigError, match="unknown target 'tpu'"):
        compile_bundle(config, "tpu", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# a GPU bundle compiled here without a GPU: bfloat16, one sequence of at most 64 tokens, steps of at most 16 tokens
# (10 programs, about 25 s on two cores)
GPU_KW = dict(dtype="bfloat16", max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16)
GPU_FLAGS = ["--dtype", "bfloat16", "--max-num-seqs", "1", "--max-model-len", "64", "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def h100_bundle(tmp_path_factory) -> Path:
    if not HAVE_CUDA:
        pytest.skip(f"no CUDA plugin in {CUDA_SITE}")
    out = tmp_path_factory.mktemp("bundles") / "tiny-llama-h100"
    assert "programs for h100" in _compile(out, GPU_FLAGS, target="h100")
    return out


@needs_cuda
@pytest.mark.slow
def test_gpu_target_compiles_without_a_gpu(h100_bundle):
    from netra_jax.targets import GPU_TARGETS

    manifest = bundle.read_manifest(h100_bundle)
    assert manifest["target"] == "h100"
    sig = manifest["signature"]
    assert sig["platform"] == "gpu" and sig["device"] == GPU_TARGETS["h100"].device_kind == "NVIDIA H100 80GB HBM3"
    runner = json.loads(sig["runner"])
    assert runner["backend"] != "cpu" and runner["matmul_backend"] == "gpu"
    kinds = {p["kind"] for p in manifest["programs"]}
    assert kinds == {"step", "widen", "sampler", "logprobs"}
    assert all((h100_bundle / p["file"]).stat().st_size == p["bytes"] > 0 for p in manifest["programs"])


@needs_cuda
@pytest.mark.slow
def test_gpu_bundle_is_refused_on_this_host(h100_bundle, caplog):
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        llm = LLM(MODEL, compiled=h100_bundle, **GPU_KW)
    report = llm.engine.compiled_report
    assert report.loaded == 0 and not llm.engine.runner.programs
    assert "platform (bundle gpu, this engine cpu)" in report.mismatch
    assert "device (bundle NVIDIA H100 80GB HBM3, this engine " in report.mismatch
    assert len(_refused(caplog, h100_bundle)) == 1
    (res,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(res.outputs[0].token_ids) == 2
