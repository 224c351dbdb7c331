"""The GPU check (benchmarks/gpu_check.sh): its dry run on the CPU measures every section with numbers and no errors
while importing only what the GPU image has plus the carried wheels; a spent budget is recorded, not lost; the
synthetic tokenizer of its model directory round-trips; every carried wheel has a version to pin."""

from __future__ import annotations

import importlib.metadata
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SECTIONS = ["device", "serve", "serve_fp8", "model", "correctness", "attention", "kernels", "quant", "peers"]


def _env(tmp_path: Path, guard: bool = True) -> dict:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
    }
    if guard:  # tests/gpu_image/sitecustomize.py: only the GPU image's packages and the carried wheels import
        env["PYTHONPATH"] = str(REPO / "tests" / "gpu_image")
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "results"
    cmd = ["bash", str(BENCH / "gpu_check.sh"), str(out), "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=_env(tmp))
    (found,) = out.glob("*-gpu_check-cpu-dry.json")
    return r, json.loads(found.read_text()), found.with_suffix(".md").read_text(), out


@pytest.mark.slow  # the dry run of every section: about 150 s
def test_dry_run_measures_every_section(dry_run):
    r, res, md, out_dir = dry_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert res["dry_run"] and list(res["sections"]) == SECTIONS
    for name, s in res["sections"].items():
        assert s["status"] == "ok" and not s.get("error"), (name, s)
    s = res["sections"]
    assert s["device"]["copy_gbps"] > 0 and s["device"]["matmul_tflops"] > 0
    measured = [c for c in s["correctness"]["results"] if "skipped" not in c]
    assert {c["backend"] for c in measured} == {"mosaic", "triton"}
    assert all(c["ok"] and c["rel_err"] < 2e-2 for c in measured)
    assert all("Mosaic GPU attention takes" in c["skipped"] for c in s["correctness"]["results"] if "skipped" in c)
    kernels = s["kernels"]["cases"]  # one small case of each kernel of the compile check's list, interpreted
    assert {c["kernel"] for c in kernels} == {"mosaic", "triton", "grouped_matmul", "packed_matmul", "fp8"}
    assert all(c["ok"] and c["rel_err"] < 2e-2 for c in kernels)
    decode = {row["impl"]: row for row in s["attention"]["decode"]}
    assert all(decode[i]["us"] > 0 and decode[i]["frac_copy_bw"] > 0 for i in ("mosaic", "triton", "xla_dense"))
    assert {row["impl"] for row in s["attention"]["mixed"] if "us" in row} == {"mosaic", "triton"}
    assert {w["impl"] for w in s["attention"]["kv_write"] if w["written_ok"]} == {"xla_scatter", "pallas_triton"}
    model = s["model"]
    assert model["batch1"][0]["decode_tok_s"] > 0 and model["batch1"][0]["mbu"] > 0
    profiles = model["profile"]  # steady decode traced at 1 and 4 users: the host's XLA ops stand in on the CPU
    assert [p["users"] for p in profiles] == [1, 4]
    assert all(p["source"] == "cpu" and p["kernels_per_step"] > 0 and p["output_tok_s"] > 0 for p in profiles)
    assert all(sum(c["us"] for c in p["classes"].values()) > 0 and p["steps"] > 0 for p in profiles)
    warm = model["ready"]["warmup"]  # capped at a few seconds in the dry run: the incomplete path
    assert model["ready"]["build_s"] > 0 and 1 <= warm["compiled"] <= warm["step_variants"]
    assert warm["complete"] or warm["estimated_full_s"] > 0
    assert model["compiles_after_warmup"]["total"] >= 0
    quant = s["quant"]  # int4 on the packed kernel (interpreted) and fp8 weights
    assert [r["method"] for r in quant["ready"]] == ["int4", "fp8"]
    assert [r["weights"] for r in quant["ready"]] == ["PackedIntWeight", "QuantizedWeight"]
    assert {r["matmul_backend"] for r in quant["ready"]} == {"gpu_interpret"}
    assert all(r["weights_gb"] > 0 for r in quant["ready"])
    assert quant["ready"][0]["weights_gb"] < quant["ready"][1]["weights_gb"]  # 4.5 bits per weight against 8
    assert all(b["decode_tok_s"] > 0 and b["mbu"] > 0 for b in quant["batch1"])
    assert all(t["output_tok_s"] > 0 and t["batch"] == 4 for t in quant["throughput"])
    for name in ("serve", "serve_fp8"):  # served from a CPU bundle compiled first: nothing compiles at start
        sv = s[name]
        assert sv["bundle_built"]["status"] == 0 and sv["bundle"]
        assert sv["start"]["programs_loaded"] > 0 and sv["start"]["programs_compiled"] == 0, sv["start"]
        assert "bundle_mismatch" not in sv["start"]
        assert [(lv["sweep"], lv["users"]) for lv in sv["levels"]] == [
            ("short", 1),
            ("short", 4),
            ("long", 1),
            ("long", 2),
        ]
        assert all(lv["failed"] == 0 and lv["output_throughput"] > 0 for lv in sv["levels"])
        assert "via /detokenize" in sv["levels"][0]["text_source"]  # the synthetic tokenizer served the prompts
        assert sv["sizing"]["num_kv_pages"] > 0 and sv["sizing"]["max_num_seqs"] == 4
    assert "--quantization fp8" in s["serve_fp8"]["server_args"]
    (serve_json,) = out_dir.glob("*-gpu_serve-cpu-dry.json")
    head = json.loads(serve_json.read_text())
    assert set(head["variants"]) == {"bf16", "fp8"} and head["anchors"][0]["output_tok_s"][2] == 12215
    assert serve_json.with_suffix(".png").stat().st_size > 0
    assert "NVIDIA NIM" in serve_json.with_suffix(".md").read_text()
    peers = s["peers"]["hf_generate"] + s["peers"]["flash_sdpa"]
    assert all("skipped" in p or p.get("decode_tok_s") or p.get("output_tok_s") or p.get("us") for p in peers)
    for title in (
        "## 1. Correctness",
        "## 1b. Kernel configurations",
        "## 2. Paged attention",
        "## 3. Llama-3.1-8B",
        "## 3b. The same model quantized",
        "## 4. Serving",
        "## Goals",
    ):
        assert title in md


def test_spent_budget_is_recorded(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", str(out), "--dry-run", "--budget", "1"]
    cmd += ["--work-dir", str(tmp_path)]
    env = _env(tmp_path, guard=False) | {"PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 1
    (found,) = out.glob("*-gpu_check-cpu-dry.json")
    res = json.loads(found.read_text())
    assert list(res["sections"]) == SECTIONS
    assert all(s["status"] == "skipped" and "time budget" in s["error"] for s in res["sections"].values())
    assert "time budget" in found.with_suffix(".md").read_text()


def test_synthetic_tokenizer_round_trips(tmp_path):
    from benchmarks.gpu_check.model_dir import LLAMA31_8B, ensure_model_dir
    from netra_jax.tokenization.tokenizer import Tokenizer

    path = ensure_model_dir(tmp_path, dry=False)
    assert json.loads((path / "config.json").read_text()) == LLAMA31_8B
    tok = Tokenizer.load(path)
    rng = random.Random(0)
    ids = [rng.randrange(LLAMA31_8B["vocab_size"]) for _ in range(500)] + [0, 1, LLAMA31_8B["vocab_size"] - 1]
    text = tok.decode(ids, skip_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) == ids


def test_every_carried_wheel_has_a_version_to_pin():
    names = [s.strip() for s in (BENCH / "gpu_wheels.txt").read_text().splitlines() if s.strip()[:1] not in ("", "#")]
    assert "fastapi" in names and "uvicorn" in names and "pydantic-core" in names
    for n in names:
        assert importlib.metadata.version(n)
    image = (BENCH / "gpu_image_packages.txt").read_text().split()
    assert "jax" in image and "tokenizers" in image and "fastapi" not in image
