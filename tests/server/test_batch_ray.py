"""Ray Data scale-out of batch jobs on a local CPU cluster: two engine actors give the same output lines as the
single-process run (order aside), and a Ray run resumes a truncated output file. Skipped without netra-jax[ray]."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", exc_type=ImportError)
pytest.importorskip("ray.data", exc_type=ImportError)

from test_batch import CONFIG, make_batch, outcome, read_out  # noqa: E402

from netra_jax.serving.batch import run_batch  # noqa: E402
from netra_jax.serving.batch_ray import run_batch_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_actors_match_single_process_and_resume(cluster, tmp_path):
    lines, expect = make_batch(seed=1)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    single = tmp_path / "single.jsonl"
    run_batch(path, single, engine_config=CONFIG, progress=False)
    ref = {k: outcome(o) for k, o in read_out(single).items()}
    assert set(ref) == set(expect)

    out = tmp_path / "ray.jsonl"
    summary = run_batch_ray(path, out, CONFIG, replicas=2, batch_size=16, progress=False)
    assert (summary.requests, summary.completed + summary.errors, summary.skipped) == (200, 200, 0)
    assert {k: outcome(o) for k, o in read_out(out).items()} == ref

    head = single.read_text().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(head[:150]) + head[150][:40])  # killed mid-write
    summary = run_batch_ray(path, resumed, CONFIG, replicas=2, batch_size=16, progress=False)
    assert (summary.skipped, summary.completed + summary.errors) == (150, 50)
    assert {k: outcome(o) for k, o in read_out(resumed).items()} == ref


def test_ray_actors_serve_lora_adapters_by_model(cluster, tmp_path):
    """Each engine actor reads --lora-modules' adapters: lines selecting them by body.model give transformers + PEFT's
    greedy tokens, the base model's lines the base's, an unknown name a 404 line."""
    import dataclasses
    import json

    from support.checkpoints import DATA, reference

    from netra_jax.engine_config import LoRAConfig
    from netra_jax.serving.lora_modules import parse_lora_modules

    lora, model = DATA / "lora", "tiny-llama"
    config = dataclasses.replace(CONFIG, lora=LoRAConfig(max_loras=2))  # CONFIG serves tiny-llama
    refs = {name: json.loads((lora / name / "reference.json").read_text()) for name in ("llama-all-r8", "llama-qv-r4")}
    want = {"all": refs["llama-all-r8"], "qv": refs["llama-qv-r4"]}
    lines = []
    for i in range(3):  # every case of each adapter, of the base model, and an unknown name
        for name in ("all", "qv", model, "nope"):
            prompt = want.get(name, refs["llama-all-r8"])["cases"][i]["prompt_ids"]
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
            body["ignore_eos"] = True
            lines.append({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    modules = parse_lora_modules([f"all={lora / 'llama-all-r8'}", f"qv={lora / 'llama-qv-r4'}"])
    summary = run_batch_ray(path, out, config, replicas=2, batch_size=4, progress=False, lora_modules=modules)
    assert (summary.requests, summary.completed, summary.errors) == (12, 9, 3)
    got = {o["custom_id"]: o["response"] for o in map(json.loads, out.read_text().splitlines())}
    base = reference(model)["cases"]
    for i in range(3):
        for name in ("all", "qv", model):
            ids = want[name]["cases"][i]["greedy_ids"] if name in want else base[i]["greedy_ids"][:8]
            assert got[f"{name}-{i}"]["body"]["choices"][0]["token_ids"] == ids, (name, i)
        assert (got[f"nope-{i}"]["status_code"], got[f"nope-{i}"]["body"]["error"]["code"]) == (404, "model_not_found")
