"""lm-evaluation-harness against `netra-jax serve`, checked against transformers: lm-eval's `local-completions` model
(remote tokenizer: /tokenizer_info and /tokenize) runs the local multiple-choice task netra_mc (tests/fixtures/lm_eval:
40 sentence completions, four choices each, no downloads) through completions `echo` + `logprobs`; transformers
computes the same per-choice loglikelihoods on the same weights in a peer interpreter. Reports max |diff| and both
accuracies per model: the tiny transformers fixtures and SmolLM2-135M-Instruct (its Q4_1 GGUF file, which both sides
de-quantize to float32).

Usage: `.venv/bin/python -m benchmarks.lm_eval_loglikelihood [--models tiny-qwen3,smollm2] [--hf-python PY]
[--out-dir DIR]`. The transformers side runs tests/fixtures/lm_eval/make_reference.py in the interpreter given by
--hf-python, NETRA_HF_PYTHON, or found as benchmarks.hf_baseline.find_hf_python does. Writes
<out-dir>/<date>-lm_eval_loglikelihood.json (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.hf_baseline import find_hf_python
from benchmarks.phases import run_record

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TASK_DIR = REPO / "tests" / "fixtures" / "lm_eval"
TASK = "netra_mc"
FIXTURES = Path(os.environ.get("NETRA_JAX_FIXTURES", REPO.parent / "shared" / "fixtures"))
TINY_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3"]
SERVER_ARGS = "--dtype float32 --max-num-seqs 16 --max-num-batched-tokens 256"
TOLERANCE = 1e-3  # the bound on |ours - transformers| per choice


def task_config() -> dict:
    """netra_mc.yaml as a task config dict, its data file given by absolute path (found wherever this runs)."""
    cfg = yaml.safe_load((TASK_DIR / f"{TASK}.yaml").read_text())
    cfg["dataset_kwargs"]["data_files"] = {"test": str(TASK_DIR / "mc.jsonl")}
    return cfg


def run_lm_eval(base_url: str, model_name: str, batch_size: int = 8) -> dict:
    """lm-eval's simple_evaluate with `local-completions` on the server at `base_url` (offline: no hub, no dataset
    downloads). Returns {"accuracy", "docs": [{"loglikelihoods": per choice, "answer"}]} in document order."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(
        model="local-completions",
        model_args={
            "model": model_name,
            "base_url": base_url + "/v1/completions",
            "tokenizer_backend": "remote",
            "max_retries": 1,
        },
        tasks=[task_config()],
        task_manager=TaskManager(include_defaults=False),  # no scan of the thousands of built-in task files
        batch_size=batch_size,
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    docs = [{"loglikelihoods": [float(r[0]) for r in s["filtered_resps"]], "answer": int(s["target"])} for s in samples]
    return {"accuracy": res["results"][TASK]["acc,none"], "docs": docs}


def transformers_reference(hf_python: str, model: Path) -> dict:
    """tests/fixtures/lm_eval/make_reference.py on `model` in the peer interpreter; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference.json"
        cmd = [hf_python, str(TASK_DIR / "make_reference.py"), "--model", str(model), "--out", str(out)]
        subprocess.run(
            cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "NETRA_JAX_FIXTURES": str(FIXTURES)}
        )
        return json.loads(out.read_text())


def best_choice(doc: dict) -> int:
    lls = doc["loglikelihoods"]
    return max(range(len(lls)), key=lls.__getitem__)


def compare(ours: dict, ref: dict) -> dict:
    """Max |diff| over every choice and both accuracies; `argmax_agree`: documents whose best choice is the same."""
    pairs = [
        (a, b)
        for x, y in zip(ours["docs"], ref["docs"], strict=True)
        for a, b in zip(x["loglikelihoods"], y["loglikelihoods"], strict=True)
    ]
    return {
        "choices": len(pairs),
        "max_abs_diff": max(abs(a - b) for a, b in pairs),
        "within_tolerance": all(abs(a - b) <= TOLERANCE for a, b in pairs),
        "accuracy_ours": ours["accuracy"],
        "accuracy_transformers": ref["accuracy"],
        "argmax_agree": sum(best_choice(x) == best_choice(y) for x, y in zip(ours["docs"], ref["docs"], strict=True)),
        "documents": len(ours["docs"]),
    }


def model_path(name: str) -> Path:
    if name == "smollm2":
        from netra_jax.assets import default_model_path

        return default_model_path()
    return FIXTURES / name


def main() -> None:
    from netra_jax.bench.launch import launched
    from netra_jax.serving.context import served_model_name

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join([*TINY_MODELS, "smollm2"]))
    p.add_argument("--hf-python", default=None)
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size (prompts per request)")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    a = p.parse_args()
    hf_python = find_hf_python(a.hf_python)
    if hf_python is None:
        raise SystemExit("no interpreter with torch + transformers: pass --hf-python or set NETRA_HF_PYTHON")
    record = run_record("lm_eval_loglikelihood", {})
    record |= {"task": TASK, "server_args": SERVER_ARGS, "tolerance": TOLERANCE, "models": {}}
    for name in a.models.split(","):
        path = model_path(name)
        t0 = time.monotonic()
        with launched(f"{path} {SERVER_ARGS}") as url:
            ours = run_lm_eval(url, served_model_name(str(path)), a.batch_size)
        t1 = time.monotonic()
        ref = transformers_reference(hf_python, path)
        row = compare(ours, ref) | {
            "model": str(path.name),
            "serve_and_lm_eval_s": round(t1 - t0, 1),  # server start (warm-up) included
            "transformers_s": round(time.monotonic() - t1, 1),
            "transformers": ref["generated_by"],
        }
        record["models"][name] = row
        print(json.dumps({name: row}), flush=True)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    out = a.out_dir / f"{datetime.date.today().isoformat()}-lm_eval_loglikelihood.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
