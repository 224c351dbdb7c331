"""LoRA adapters in the pure forward against transformers + PEFT: the PEFT adapters of tests/fixtures/lora (random,
made by tests/fixtures/make_lora_adapters.py over the tiny Llama, Qwen3 and Gemma 3 fixtures) give PEFT's logits at
every position and its greedy tokens; slots mixing adapters in one batch give each token its own adapter's logits;
bad adapters are refused naming the problem."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES, reference

from netra_jax.loader import load_model
from netra_jax.models import lora as L
from netra_jax.models.transformer import forward_dense

LORA = DATA / "lora"
ADAPTERS = sorted(p.name for p in LORA.iterdir() if p.is_dir())
BASES = {"llama": "tiny-llama", "qwen3": "tiny-qwen3", "gemma3": "tiny-gemma3"}


def _ref(name: str) -> tuple[dict, dict]:
    return json.loads((LORA / name / "reference.json").read_text()), dict(np.load(LORA / name / "reference.npz"))


@pytest.fixture(scope="module")
def models():
    return {base: load_model(FIXTURES / base, dtype="float32", cache=False) for base in BASES.values()}


def _greedy(params, cfg, slots, slot, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = forward_dense(params, cfg, jnp.asarray(ids, jnp.int32), lora=slots, lora_slot=slot)
        ids.append(int(jnp.argmax(logits[-1])))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", ADAPTERS)
def test_logits_and_greedy_match_peft(models, name):
    ref, logits = _ref(name)
    cfg, params = models[ref["base"]]
    adapter = L.load_peft_adapter(LORA / name, cfg, max_rank=16)
    slots = L.set_slot(cfg, L.empty_slots(cfg, 3, 16), 1, adapter)  # slot 1 of 3, padded from its rank to 16
    base_greedy = [c["greedy_ids"][:8] for c in reference(ref["base"])["cases"]]
    changed = False
    for i, case in enumerate(ref["cases"]):
        if f"logits_{i}" in logits:
            got = np.asarray(
                forward_dense(params, cfg, jnp.asarray(case["prompt_ids"], jnp.int32), lora=slots, lora_slot=1)
            )
            assert np.abs(got - logits[f"logits_{i}"]).max() < 1e-4, name
        assert _greedy(params, cfg, slots, 1, case["prompt_ids"], 8) == case["greedy_ids"], (name, i)
        changed |= case["greedy_ids"] != base_greedy[i]
    assert changed, "the adapter must change some greedy answer, or the comparison shows nothing"


def test_slot_minus_one_is_the_base_model(models):
    cfg, params = models["tiny-llama"]
    slots = L.set_slot(cfg, L.empty_slots(cfg, 2, 8), 0, L.load_peft_adapter(LORA / "llama-all-r8", cfg))
    case = reference("tiny-llama")["cases"][1]
    ids = jnp.asarray(case["prompt_ids"], jnp.int32)
    base = np.asarray(forward_dense(params, cfg, ids))
    assert np.array_equal(np.asarray(forward_dense(params, cfg, ids, lora=slots, lora_slot=-1)), base)
    assert np.abs(base - np.asarray(case["logits"], np.float32)).max() < 1e-4


def test_tokens_of_one_batch_use_their_own_slots(models):
    """Four adapters and the base in one flat batch: each token's delta is its own slot's, bit for bit what a batch
    of that slot alone gives."""
    cfg, params = models["tiny-llama"]
    names = [n for n in ADAPTERS if n.startswith("llama")][:4]
    slots = L.empty_slots(cfg, 4, 16)
    for s, n in enumerate(names):
        slots = L.set_slot(cfg, slots, s, L.load_peft_adapter(LORA / n, cfg))
    rng = np.random.default_rng(0)
    which = jnp.asarray([0, 1, -1, 2, 3, 3, 0, -1, 1, 2], jnp.int32)
    for t, group in slots[0].items():
        x = jnp.asarray(rng.standard_normal((10, group[0].shape[0])), jnp.float32)  # [T, in]
        mixed = np.asarray(L.lora_delta(x, group, which))
        for s in range(-1, 4):
            alone = np.asarray(L.lora_delta(x, group, jnp.full((10,), s, jnp.int32)))
            rows = np.asarray(which) == s
            assert np.array_equal(mixed[rows], alone[rows]), (t, s)
        assert not mixed[np.asarray(which) == -1].any()


def test_gradient_reaches_the_factors(models):
    cfg, params = models["tiny-qwen3"]
    slots = L.set_slot(cfg, L.empty_slots(cfg, 1, 8), 0, L.load_peft_adapter(LORA / "qwen3-all-r8", cfg))
    ids = jnp.asarray(reference("tiny-qwen3")["cases"][1]["prompt_ids"], jnp.int32)

    def loss(slots):
        logits = forward_dense(params, cfg, ids[:-1], lora=slots, lora_slot=0)
        return -jax.nn.log_softmax(logits)[jnp.arange(ids.shape[0] - 1), ids[1:]].mean()

    grads = jax.grad(loss)(slots)
    a, b = grads[0]["qkv"]
    assert float(jnp.abs(a).max()) > 0 and float(jnp.abs(b).max()) > 0


def _copy(name, tmp_path):
    d = tmp_path / name
    shutil.copytree(LORA / name, d)
    return d


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all'"),
        ({"use_dora": True}, "use_dora"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 0}, "r must be a positive number"),
    ],
)
def test_refused_settings_are_named(models, tmp_path, edit, match):
    cfg, _ = models["tiny-llama"]
    d = _copy("llama-all-r8", tmp_path)
    conf = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**conf, **edit}))
    with pytest.raises(L.LoRAError, match=match):
        L.load_peft_adapter(d, cfg)


def test_bad_tensors_are_named(models, tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg, _ = models["tiny-llama"]
    with pytest.raises(L.LoRAError, match="rank 16, over max_lora_rank=8"):
        L.load_peft_adapter(LORA / "llama-mlp-r16", cfg, max_rank=8)
    qwen_cfg, _ = models["tiny-qwen3"]
    narrower = r"down_proj: lora_A \[8, 160\] and lora_B \[64, 8\] do not fit the projection \[128 -> 64\]"
    with pytest.raises(L.LoRAError, match=narrower):
        L.load_peft_adapter(LORA / "llama-all-r8", qwen_cfg)  # qwen3's MLP is narrower
    d = _copy("llama-qv-r4", tmp_path)
    f = d / "adapter_model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if "lora_B" in k)
    save_file({k: v for k, v in tensors.items() if k != key}, f)
    with pytest.raises(L.LoRAError, match="has no lora_B"):
        L.load_peft_adapter(d, cfg)
    save_file({**tensors, "base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight": tensors[key]}, f)
    with pytest.raises(L.LoRAError, match="targets expert weights"):
        L.load_peft_adapter(d, cfg)
    save_file({**tensors, key.replace("layers.0", "layers.7"): tensors[key]}, f)
    with pytest.raises(L.LoRAError, match="layer 7; the model has 2"):
        L.load_peft_adapter(d, cfg)
    with pytest.raises(L.LoRAError, match="no adapter_config.json"):
        L.load_peft_adapter(tmp_path, cfg)
