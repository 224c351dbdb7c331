"""netra_jax.bench.limits: the costs it reads off a GGUF file (a random Llama-shaped Q8_0 file whose shapes are
known: tied embeddings, so the table is read once, as the lm_head) and the fractions it reports of a served result
against given limits, checked by hand."""

from __future__ import annotations

import gguf
import pytest

from benchmarks import random_gguf
from netra_jax.bench.limits import ModelCosts, model_costs, table

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}


def test_costs_of_a_gguf_file(tmp_path, smollm2_path):
    info = random_gguf.write(tmp_path / "tiny.gguf", "q8_0", tokenizer_from=smollm2_path, seed=1, **SHAPE)
    costs = model_costs(info["path"])
    head_dim = SHAPE["hidden"] // SHAPE["heads"]
    layer = sum(a * b for a, b in random_gguf.matrix_shapes(64, 4, 2, 128).values())
    assert costs.matmul_params == info["vocab"] * 64 + 2 * layer == info["parameters"] - 5 * 64  # norms left out
    tensors = gguf.GGUFReader(info["path"]).tensors
    assert costs.weight_bytes == sum(int(t.n_bytes) for t in tensors)  # norms too; Q8_0: 34 bytes per 32 weights
    assert costs.weight_bytes < 1.1 * 34 / 32 * info["parameters"] + 4 * 64 * 5
    assert costs.kv_elements_per_token == 2 * 2 * 2 * head_dim
    assert costs.attention_flops_per_key == 2 * 4 * 4 * head_dim


def test_fractions_against_the_limits():
    costs = ModelCosts(
        weight_bytes=500_000_000, matmul_params=100_000_000, kv_elements_per_token=1000, attention_flops_per_key=2000
    )
    result = {
        "config": {"input_len": 100, "output_len": 100},  # the mean decode position: 150
        "runs": [
            {"max_concurrency": 1, "median_tpot_ms": 25.0, "output_throughput": 40.0},
            {"max_concurrency": 32, "median_tpot_ms": 100.0, "output_throughput": 320.0},
            {"max_concurrency": 64, "median_tpot_ms": None, "output_throughput": 0.0},  # failed: no row
        ],
    }
    limits = [{"read_gbs": 20.0, "fma_gflops": 300.0}, {"read_gbs": 30.0, "fma_gflops": 200.0}]  # mean 25, 250
    rows = [
        ln
        for ln in table(limits, [(result, "engine", 4, costs)]).splitlines()
        if ln.startswith("| engine | ") and ln.split("|")[2].strip().isdigit()
    ]
    assert len(rows) == 2
    one = 500e6 + 1 * 150 * 1000 * 4  # bytes: the weights once, the KV of one sequence
    assert rows[0].split("|")[5:8] == [
        f" {one / 1e6:.0f} ",
        f" {one / 0.025 / 1e9 / 25:.2f} ",
        f" {(2e8 + 150 * 2000) / 0.025 / 1e9 / 250:.3f} ",
    ]
    flops = 32 * (2e8 + 150 * 2000)
    assert rows[1].split("|")[7] == f" {flops / 0.1 / 1e9 / 250:.3f} "
    assert pytest.approx(flops / 0.1 / 1e9 / 250, abs=1e-3) == float(rows[1].split("|")[7])
