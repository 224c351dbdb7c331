"""Smoke test of benchmarks/offline_throughput.py on a tiny fixture model at tiny sizes (no Hugging Face baseline),
plus the roofline cost formulas (benchmarks/step_profile/roofline.py) and the prompt list."""

from __future__ import annotations

import json

from support.checkpoints import FIXTURES

from benchmarks import offline_throughput as ot
from benchmarks.step_profile import roofline as rl


def test_questions_distinct_and_deterministic():
    qs = ot.questions(64)
    assert len(set(qs)) == 64 and qs == ot.questions(64)
    assert len(set(ot.questions(70))) == 70


def test_costs_match_smollm2_shape():
    from netra_jax.config import ModelConfig

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        layer_types=("full_attention",) * 30,
    )
    assert rl.matmul_params(cfg) == 30 * 3_538_944 + 576 * 49152  # 134,479,872: all but the norms
    assert rl.attention_flops_per_token(cfg, 100) == 30 * 4 * 576 * 100
    c = rl.decode_step_costs(cfg, batch=64, context=100)
    assert c["flops_per_step"] == 64 * (2 * rl.matmul_params(cfg) + 30 * 4 * 576 * 100)
    assert c["bytes_per_step"] == 4 * rl.matmul_params(cfg) + 64 * 2 * 30 * 192 * 100 * 4


def test_agreement_stops_at_first_eos():
    a = ot.agreement([[5, 6, 2, 9], [5, 6, 7, 8]], [[5, 6, 3, 3], [5, 1, 7, 8]], eos_ids=[2])
    assert a == {"identical_until_eos": 1, "of": 2, "mean_common_prefix": 1.5}


def test_quick_run_writes_result(tmp_path, capsys):
    out = tmp_path / "r.json"
    ot.main(
        [
            "--quick",
            "--model",
            str(FIXTURES / "tiny-llama"),
            "--no-hf",
            "--max-num-batched-tokens",
            "64",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    f = r["figures"]
    assert f["ours_tok_s"] > 0 and f["ours_batch1_tok_s"] > 0 and f["batch1_roofline_tok_s"] > 0
    assert 0 < f["ours_frac_peak"] < 1.5
    assert r["settings"]["num_prompts"] == 4 and r["settings"]["max_tokens"] == 8
    assert r["peaks"]["matmul_peak_gflops"] > 0 and r["peaks"]["bandwidth_gbs"] > 0
    assert len(r["machine"]["loadavg"]) == 3 and "ours_batch_0" in r["phases"]
    prof = r["ours"]["profile"]["batch"]
    assert prof["full_decode_steps"] > 0 and "matmuls_ms" in prof["components"], prof
    assert "hf_tok_s" not in f and r["hf"] is None
    assert "ours  batch 4 x 8" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 10_000  # the plot next to the JSON
