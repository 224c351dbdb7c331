"""LoRA adapters under tensor parallelism, on 4 fake CPU devices in a subprocess: the slots split as the weights they
modify (B of q/k/v and gate/up by outputs, A of o and down by inputs), tp = 2 and tp = 4 (KV heads repeated) give
transformers + PEFT's greedy tokens for a batch mixing adapters and the base model, and the logits of one device."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES, reference
from support.workers import run_device_worker

BASE = "tiny-llama"  # 4 heads, 2 KV heads: tp = 4 repeats each KV head twice
ADAPTERS = ("llama-all-r8", "llama-qv-r4", "llama-mlp-r16", "llama-attn-rslora")
TPS = (1, 2, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_device_worker(__file__, tmp_path_factory.mktemp("lora_tp") / "results.json")


def _expected() -> list[tuple[str | None, list[int], list[int]]]:
    """(adapter or None, prompt, greedy ids) for every case of every adapter and of the base model."""
    cases = [(None, c["prompt_ids"], c["greedy_ids"][:8]) for c in reference(BASE)["cases"]]
    for name in ADAPTERS:
        ref = json.loads((DATA / "lora" / name / "reference.json").read_text())
        cases += [(name, c["prompt_ids"], c["greedy_ids"]) for c in ref["cases"]]
    return cases


def test_mixed_batch_gives_pefts_greedy_tokens_at_every_tp(results):
    want = [ids for _, _, ids in _expected()]
    for tp in TPS:
        assert results[str(tp)]["greedy"] == want, tp


def test_logprobs_match_one_device(results):
    base = np.asarray(results["1"]["logprobs"], np.float64)
    for tp in TPS[1:]:
        assert np.abs(np.asarray(results[str(tp)]["logprobs"], np.float64) - base).max() < 1e-4, tp


def test_slots_split_as_the_weights_they_modify(results):
    specs = results["4"]["specs"]
    assert specs["qkv"] == [[], [None, None, "tp"]] and specs["gate_up"] == [[], [None, None, "tp"]]
    assert specs["o"] == [["tp", None, None], []] and specs["down"] == [["tp", None, None], []]
    shards = results["4"]["shards"]  # per device: B of q/k/v a quarter of its columns (KV heads repeated: 4 x 16)
    assert shards["qkv_b"] == [[4, 3 * 16, (64 + 2 * 64) // 4]] * 4
    assert shards["down_a"] == [[160 // 4, 4, 16]] * 4


# ------------------------------------------------------------------------------------------ the worker
def _worker(out_path: str) -> None:
    import jax

    from netra_jax import LLM, LoRARequest, SamplingParams

    assert len(jax.devices()) == 4
    cases = _expected()
    requests = {name: LoRARequest(name, k + 1, str(DATA / "lora" / name)) for k, name in enumerate(ADAPTERS)}
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    results = {}
    for tp in TPS:
        llm = LLM(
            FIXTURES / BASE,
            dtype="float32",
            tensor_parallel_size=tp,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            max_num_seqs=16,
            num_kv_pages=64,
            warmup=False,
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p, _ in cases],
            greedy,
            lora_request=[None if a is None else requests[a] for a, _, _ in cases],
            use_tqdm=False,
        )
        r = {
            "greedy": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[float(next(iter(lp.values())).logprob) for lp in o.outputs[0].logprobs] for o in outs],
        }
        if tp == 4:
            layer = llm.engine.runner.lora[0]
            r["specs"] = {g: [list(a.sharding.spec), list(b.sharding.spec)] for g, (a, b) in layer.items()}
            r["shards"] = {
                "qkv_b": [list(s.data.shape) for s in layer["qkv"][1].addressable_shards],
                "down_a": [list(s.data.shape) for s in layer["down"][0].addressable_shards],
            }
        results[str(tp)] = r
        del llm
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _worker(sys.argv[1])
