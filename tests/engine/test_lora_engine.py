"""LoRA adapters through the engine and `LLM.generate` (vLLM's interface): greedy tokens of every fixture adapter equal
transformers + PEFT's; a 32-request batch mixing four adapters and the base model gives each request what it gives
alone; five adapters through two device slots swap in and out with unchanged outputs; the prefix cache never shares
KV between adapters; bad adapters fail their request only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES, reference

from netra_jax import LLM, LoRARequest, SamplingParams
from netra_jax.models.lora import LoRAError, load_peft_adapter

LORA = DATA / "lora"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LLAMA = sorted(p.name for p in LORA.iterdir() if p.name.startswith("llama"))  # five adapters of tiny-llama


def _ref(name: str) -> dict:
    return json.loads((LORA / name / "reference.json").read_text())


def _request(name: str) -> LoRARequest:
    return LoRARequest(name, LLAMA.index(name) + 1 if name in LLAMA else 100, str(LORA / name))


def _llm(model: str, **kw) -> LLM:
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_pages": 128, "dtype": "float32", **kw}
    return LLM(FIXTURES / model, enable_lora=True, max_lora_rank=16, **kw)


def _check_idle(llm) -> None:
    pool = llm.engine.pool
    pool.check_invariant()
    assert pool.num_in_use == 0


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama():
    return _llm("tiny-llama", max_loras=4, max_cpu_loras=8)


@pytest.mark.parametrize("name", ["qwen3-all-r8", "gemma3-all-r8"])
def test_greedy_equals_peft_on_other_families(name):
    ref = _ref(name)
    llm = _llm(ref["base"], max_loras=1)
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in ref["cases"]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 1, str(LORA / name)))
    assert _tokens(outs) == [c["greedy_ids"] for c in ref["cases"]]


def test_greedy_equals_peft_for_every_llama_adapter(llama):
    for name in LLAMA:
        ref = _ref(name)
        prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in ref["cases"]]
        outs = llama.generate(prompts, GREEDY, use_tqdm=False, lora_request=_request(name))
        assert _tokens(outs) == [c["greedy_ids"] for c in ref["cases"]], name
    base = llama.generate([{"prompt_token_ids": c["prompt_ids"]} for c in ref["cases"]], GREEDY, use_tqdm=False)
    assert _tokens(base) == [c["greedy_ids"][:8] for c in reference("tiny-llama")["cases"]]  # the base is untouched


def test_mixed_batch_equals_each_request_alone(llama):
    rng = np.random.default_rng(0)
    names = [None, *LLAMA[:4]]
    prompts, loras = [], []
    for i in range(32):
        prompts.append({"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist()})
        name = names[i % len(names)]
        loras.append(None if name is None else _request(name))
    batched = _tokens(llama.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    alone = [
        _tokens(llama.generate([p], GREEDY, use_tqdm=False, lora_request=r))[0]
        for p, r in zip(prompts, loras, strict=True)
    ]
    assert batched == alone
    assert len({tuple(t) for t in batched[:5]}) == 5  # five different models answered the first five
    _check_idle(llama)


def test_five_adapters_through_two_slots():
    llm = _llm("tiny-llama", max_loras=2, max_cpu_loras=3)
    prompts, loras, want = [], [], []
    for name in LLAMA:
        for c in _ref(name)["cases"]:
            prompts.append({"prompt_token_ids": c["prompt_ids"]})
            loras.append(_request(name))
            want.append(c["greedy_ids"])
    order = np.random.default_rng(1).permutation(len(prompts))  # adapters interleaved: slots must swap
    outs = llm.generate([prompts[i] for i in order], GREEDY, use_tqdm=False, lora_request=[loras[i] for i in order])
    assert _tokens(outs) == [want[i] for i in order]
    # the scheduler admits at most two adapters at once, so the 15 requests ran in groups: each adapter was loaded
    # into a slot once, the first ones evicted for the later ones
    assert llm.engine.loras.num_loads == len(LLAMA) and len(llm.engine.loras.on_device) == 2
    first = LLAMA[0]  # evicted from its slot and from the host (max_cpu_loras=3): read again from its directory
    assert first not in [llm.engine.loras.known[i].lora_name for i in llm.engine.loras.on_device]
    ref = _ref(first)["cases"][0]
    again = llm.generate({"prompt_token_ids": ref["prompt_ids"]}, GREEDY, use_tqdm=False, lora_request=_request(first))
    assert _tokens(again) == [ref["greedy_ids"]] and llm.engine.loras.num_loads == len(LLAMA) + 1


def test_prefix_cache_is_per_adapter(llama):
    """A new 50-token prompt under an adapter, another adapter, the base and the first adapter again: only the last
    finds cached blocks (its own adapter's), and answers as the first did."""
    prompt = {"prompt_token_ids": list(range(400, 450))}
    pool, outs, hits = llama.engine.pool, [], []
    for name in ("llama-all-r8", "llama-qv-r4", None, "llama-all-r8"):
        before = pool.prefix_hits_tokens
        lora = None if name is None else _request(name)
        outs.append(_tokens(llama.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora))[0])
        hits.append(pool.prefix_hits_tokens - before)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 48
    assert outs[3] == outs[0] and len({tuple(o) for o in outs[:3]}) == 3


def test_bad_adapters_fail_their_request_only(llama, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(LORA / "llama-all-r8", d)
    (d / "adapter_config.json").write_text(
        json.dumps({**json.loads((d / "adapter_config.json").read_text()), "use_dora": True})
    )
    with pytest.raises(LoRAError, match="use_dora"):
        llama.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("broken", 50, str(d)))
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        llama.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 51, str(tmp_path / "x")))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'llama-all-r8'"):
        llama.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, str(LORA / "llama-qv-r4")))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(LORA / "llama-qv-r4"))
    assert not llama.engine.has_unfinished_requests()
    _check_idle(llama)  # nothing leaked
    ok = llama.generate("hello", GREEDY, use_tqdm=False, lora_request=_request("llama-qv-r4"))
    assert len(ok[0].outputs[0].token_ids) == 8


def test_lora_needs_enable_lora_and_an_adapter_in_memory_works():
    llm = LLM(FIXTURES / "tiny-llama", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=64)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=_request("llama-qv-r4"))
    research = _llm("tiny-llama", max_loras=1)
    adapter = load_peft_adapter(LORA / "llama-ko-r2", research.engine.model_config)
    ref = _ref("llama-ko-r2")
    outs = research.generate(
        [{"prompt_token_ids": c["prompt_ids"]} for c in ref["cases"]],
        GREEDY,
        use_tqdm=False,
        lora_request=LoRARequest("in-memory", 9, adapter=adapter),
    )
    assert _tokens(outs) == [c["greedy_ids"] for c in ref["cases"]]
