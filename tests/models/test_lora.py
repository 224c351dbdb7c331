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


# ---------------------------------------------------------------- training: adapter_slots, init_adapter, save


def _set_slot_numpy(cfg, slots, slot, adapter):
    """set_slot as it was written before adapter_slots (numpy assignment), the reference for its layout."""
    out = []
    for i, layer in enumerate(slots):
        new = {}
        widths = dict(L._group_shapes(cfg, i))
        for g, (a, b) in layer.items():
            targets = L.GROUPS[g]
            group_rank = a.shape[2]
            max_rank = group_rank // len(targets)
            fa = np.zeros((a.shape[0], group_rank), np.float32)
            fb = np.zeros((group_rank, b.shape[2]), np.float32)
            offset = 0
            for j, t in enumerate(targets):
                wa, wb = (None, None) if adapter is None else adapter.weights.get((i, t), (None, None))
                if wa is not None:
                    r = wa.shape[1]
                    fa[:, j * max_rank : j * max_rank + r] = wa
                    fb[j * max_rank : j * max_rank + r, offset : offset + wb.shape[1]] = wb
                offset += widths[g][1][j][1]
            new[g] = (a.at[:, slot].set(jnp.asarray(fa, a.dtype)), b.at[slot].set(jnp.asarray(fb, b.dtype)))
        out.append(new)
    return out


def _equal_trees(x, y) -> bool:
    lx, ly = jax.tree.leaves(x), jax.tree.leaves(y)
    return len(lx) == len(ly) and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(lx, ly, strict=True))


@pytest.mark.parametrize("name", ADAPTERS)
def test_set_slot_writes_the_same_layout_as_before(models, name):
    cfg, _ = models[_ref(name)[0]["base"]]
    adapter = L.load_peft_adapter(LORA / name, cfg)
    filled = L.set_slot(cfg, L.empty_slots(cfg, 3, 16), 1, adapter)
    assert _equal_trees(filled, _set_slot_numpy(cfg, L.empty_slots(cfg, 3, 16), 1, adapter))
    assert _equal_trees(L.set_slot(cfg, filled, 1, None), L.empty_slots(cfg, 3, 16))  # cleared
    one = L.adapter_slots(cfg, adapter.weights, 16)  # the same blocks, as a slot of its own
    for got, want in zip(one, filled, strict=True):
        for g in want:
            assert np.array_equal(got[g][0][:, 0], want[g][0][:, 1]) and np.array_equal(got[g][1][0], want[g][1][1])


def _trainable(cfg, rank, targets, seed):
    """init_adapter's A and, so that every factor has a gradient, a random B (the adapter after some training)."""
    adapter = L.init_adapter(cfg, jax.random.key(seed), rank, targets=targets)
    keys = jax.random.split(jax.random.key(seed + 1), len(adapter.weights))
    weights = {
        where: (a, 0.2 * jax.random.normal(k, b.shape, jnp.float32))
        for k, (where, (a, b)) in zip(keys, adapter.weights.items(), strict=True)
    }
    return L.LoRAAdapter("trained", rank, weights)


def test_gradient_through_adapter_slots_matches_finite_difference(models):
    """d loss / d (a, b) of every adapted projection, through adapter_slots (rank 4 padded to 8) and forward_dense:
    every factor gets a gradient of its own shape, and the directional derivatives along the gradient and along
    single factors (an a or a b of each target) match a central finite difference."""
    cfg, params = models["tiny-llama"]
    adapter = _trainable(cfg, 4, ("q", "k", "o", "up", "down"), seed=3)
    ids = jnp.asarray(reference("tiny-llama")["cases"][1]["prompt_ids"], jnp.int32)

    def loss(weights):  # summed next-token cross entropy
        logits = forward_dense(params, cfg, ids[:-1], lora=L.adapter_slots(cfg, weights, 8), lora_slot=0)
        return -jax.nn.log_softmax(logits)[jnp.arange(ids.shape[0] - 1), ids[1:]].sum()

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    _, grads = value_and_grad(adapter.weights)
    assert set(grads) == set(adapter.weights)
    for where, (ga, gb) in grads.items():
        a, b = adapter.weights[where]
        assert ga.shape == a.shape and gb.shape == b.shape
        assert float(jnp.abs(ga).max()) > 0 and float(jnp.abs(gb).max()) > 0, where

    norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
    directions = {"gradient": jax.tree.map(lambda g: g / norm, grads)}
    for k, (where, factor) in enumerate(
        [((0, "q"), 0), ((1, "k"), 0), ((0, "o"), 1), ((1, "up"), 0), ((1, "down"), 1)]
    ):
        d = jax.tree.map(jnp.zeros_like, adapter.weights)
        x = jax.random.normal(jax.random.key(20 + k), adapter.weights[where][factor].shape)
        d[where] = tuple(x / jnp.linalg.norm(x) if f == factor else d[where][f] for f in (0, 1))
        directions[f"{where} {'ab'[factor]}"] = d
    eps = 1e-2
    for name, d in directions.items():
        ad = float(sum(jnp.vdot(g, x) for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(d), strict=True)))
        plus, _ = value_and_grad(jax.tree.map(lambda w, x: w + eps * x, adapter.weights, d))
        minus, _ = value_and_grad(jax.tree.map(lambda w, x: w - eps * x, adapter.weights, d))
        fd = float(plus - minus) / (2 * eps)
        assert abs(ad) > 1e-2 and abs(ad - fd) <= 1e-2 * abs(ad), (name, ad, fd)


def test_init_adapter_starts_as_the_base_model(models):
    cfg, params = models["tiny-llama"]
    adapter = L.init_adapter(cfg, jax.random.key(0), 4, targets=("q", "v", "gate"))
    assert adapter.rank == 4 and adapter.targets == ["q", "v", "gate"]
    assert set(adapter.weights) == {(i, t) for i in range(cfg.num_layers) for t in ("q", "v", "gate")}
    a, b = adapter.weights[(0, "gate")]
    assert a.shape == (cfg.hidden_size, 4) and b.shape == (4, cfg.intermediate_size)
    assert a.dtype == jnp.float32 and not b.any() and 0 < float(jnp.abs(a).max()) <= 1 / np.sqrt(cfg.hidden_size)
    ids = jnp.asarray(reference("tiny-llama")["cases"][0]["prompt_ids"], jnp.int32)
    slots = L.adapter_slots(cfg, adapter.weights, 8)
    assert np.array_equal(forward_dense(params, cfg, ids, lora=slots, lora_slot=0), forward_dense(params, cfg, ids))
    with pytest.raises(L.LoRAError, match="each must be one of"):
        L.init_adapter(cfg, jax.random.key(0), 4, targets=("q_proj",))


def test_adapter_slots_refuses_what_does_not_fit(models):
    cfg, _ = models["tiny-llama"]
    adapter = L.init_adapter(cfg, jax.random.key(0), 8, targets=("q",))
    with pytest.raises(L.LoRAError, match="layer 0 q has rank 8, over the slots' 4"):
        L.adapter_slots(cfg, adapter.weights, 4)
    with pytest.raises(L.LoRAError, match="adapter 'lora': layer 0 q has rank 8, over the slots' 4"):
        L.set_slot(cfg, L.empty_slots(cfg, 1, 4), 0, adapter)
    with pytest.raises(L.LoRAError, match=r"key \(2, 'q'\): not a target of this model"):
        L.adapter_slots(cfg, {**adapter.weights, (2, "q"): adapter.weights[(0, "q")]}, 8)
    a, b = adapter.weights[(0, "q")]
    with pytest.raises(
        L.LoRAError, match=r"layer 0 v: a \[64, 8\] and b \[8, 64\] do not fit the projection \[64 -> 32\]"
    ):
        L.adapter_slots(cfg, {(0, "v"): (a, b)}, 8)


@pytest.mark.parametrize("name", ADAPTERS)
def test_save_and_load_round_trip(models, tmp_path, name):
    """load -> save -> load gives the same factors, bit for bit (the default alpha = r writes B as held)."""
    ref, _ = _ref(name)
    cfg, _ = models[ref["base"]]
    adapter = L.load_peft_adapter(LORA / name, cfg)
    L.save_peft_adapter(adapter, tmp_path / "saved", base_model_name_or_path=ref["base"])
    back = L.load_peft_adapter(tmp_path / "saved", cfg)
    assert back.name == "saved" and back.rank == adapter.rank and set(back.weights) == set(adapter.weights)
    for where, (a, b) in adapter.weights.items():
        assert np.array_equal(back.weights[where][0], a) and np.array_equal(back.weights[where][1], b), where
    config = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == config["r"] == adapter.rank and config["base_model_name_or_path"] == ref["base"]
    assert not config["rank_pattern"] and not config["alpha_pattern"]


def test_save_with_alpha_and_mixed_ranks(models, tmp_path):
    """A trained adapter of jax arrays with two ranks: rank_pattern (and alpha_pattern without alpha) make the loader
    fold the same scale back in; with alpha, B is written divided by alpha / r. The reloaded adapter gives the same
    logits (equal without alpha, within rounding with it)."""
    from safetensors.numpy import load_file

    cfg, params = models["tiny-llama"]
    small, big = _trainable(cfg, 2, ("q", "v"), seed=5), _trainable(cfg, 6, ("down",), seed=6)
    adapter = L.LoRAAdapter("mixed", 6, {**small.weights, **big.weights})
    ids = jnp.asarray(reference("tiny-llama")["cases"][1]["prompt_ids"], jnp.int32)
    logits = jax.jit(lambda w: forward_dense(params, cfg, ids, lora=L.adapter_slots(cfg, w, 8), lora_slot=0))
    want = np.asarray(logits(adapter.weights))
    assert np.abs(want - np.asarray(forward_dense(params, cfg, ids))).max() > 1e-3  # the adapter changes the logits
    for alpha in (None, 12):
        d = L.save_peft_adapter(adapter, tmp_path / f"alpha-{alpha}", alpha=alpha)
        config = json.loads((d / "adapter_config.json").read_text())
        assert config["r"] == 6 and config["lora_alpha"] == (alpha or 6)
        assert config["rank_pattern"]["model.layers.1.self_attn.q_proj"] == 2
        assert config["alpha_pattern"] == ({} if alpha else config["rank_pattern"])
        assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
        tensors = load_file(d / "adapter_model.safetensors")
        b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]  # [out, r]
        scale = 1 if alpha is None else alpha / 6
        np.testing.assert_allclose(b, np.asarray(adapter.weights[(0, "down")][1]).T / scale, rtol=1e-6)
        assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].shape == (2, cfg.hidden_size)
        back = L.load_peft_adapter(d, cfg)
        assert back.rank == 6 and set(back.weights) == set(adapter.weights)
        for where, (a, b) in adapter.weights.items():
            np.testing.assert_array_equal(back.weights[where][0], a)
            np.testing.assert_allclose(back.weights[where][1], b, rtol=1e-6, atol=0)
        got = np.asarray(logits(jax.tree.map(jnp.asarray, back.weights)))
        assert np.array_equal(got, want) if alpha is None else np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_device_major_slots_give_the_same_deltas(models, tp):
    """Tensor parallelism's layout of the column-parallel groups (B's columns device-major): the delta put back in the
    fused order by from_device_major equals the one of the plain layout, for q/k/v and gate/up."""
    cfg, _ = models["tiny-llama"]  # 4 heads, intermediate 160: both split 2 and 4 ways
    adapter = L.load_peft_adapter(LORA / "llama-all-r8", cfg, max_rank=8)
    plain = L.set_slot(cfg, L.empty_slots(cfg, 2, 8), 1, adapter)
    split = L.set_slot(cfg, L.empty_slots(cfg, 2, 8), 1, adapter, tp=tp)
    x = jax.random.normal(jax.random.key(0), (5, cfg.hidden_size))
    slots = jnp.asarray([1, -1, 1, 0, 1], jnp.int32)
    widths = {"qkv": [cfg.q_size, cfg.kv_size, cfg.kv_size], "gate_up": [cfg.intermediate_size] * 2}
    for g, w in widths.items():
        want = L.lora_delta(x, plain[0][g], slots)
        got = L.from_device_major(L.lora_delta(x, split[0][g], slots), w, tp)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
        assert not np.allclose(np.asarray(split[0][g][1]), np.asarray(plain[0][g][1]))  # the columns did move
    for g in ("o", "down"):  # row-parallel groups keep the plain layout
        np.testing.assert_array_equal(np.asarray(split[0][g][1]), np.asarray(plain[0][g][1]))
