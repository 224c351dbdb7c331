"""The CPU decode layer (netra_jax/ops/cpu_decode_layer.cc): a decode-sized step's layers as one kernel call each
must give the jnp layers' logits and KV pages (every dense family's fixture: biases, q/k norms, Gemma 3's sandwich
norms, sliding windows and GELU; LoRA adapters mixed per token), be batch-invariant bit for bit (stream and
register-tile matmul paths, a context split into 1024-position parts, a token's adapter beside others'), leave
everything it does not take to the jnp layer, and keep SmolLM2's greedy answers to the reference chats identical to
the XLA path's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES, TINY_MODELS, reference

from netra_jax import LLM, SamplingParams, paged
from netra_jax.loader import load_model
from netra_jax.models import lora as L
from netra_jax.models.transformer import forward, fuse_qkv, init_kv_cache
from netra_jax.ops import cpu_decode_layer, cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels do not build here")

PAGE = 16


def _lora_args(seqs, lora):
    """forward's LoRA arguments for `seqs` given (slots, [adapter slot per sequence]) or None: each token its
    sequence's slot."""
    if lora is None:
        return {}
    slots, per_seq = lora
    tokens = np.concatenate([np.full(len(t), s, np.int32) for (t, _, _), s in zip(seqs, per_seq, strict=True)])
    return {"lora": slots, "lora_slots": jnp.asarray(tokens)}


def _step(params, cfg, kv, seqs, mb, lora=None):
    """One forward over `seqs`: (tokens, first position, pages) per sequence; returns (logits [S, vocab], kv).
    lora: (adapter slots, each sequence's slot) or None."""
    ids = np.concatenate([np.asarray(t, np.int32) for t, _, _ in seqs])
    lens = [p + len(t) for t, p, _ in seqs]
    batch = paged.build_batch(
        lens, [len(t) for t, _, _ in seqs], [pg for _, _, pg in seqs], page_size=PAGE, num_pages=kv.num_pages
    )
    fn = jax.jit(forward, static_argnames=("cfg", "backend", "matmul_backend"))
    logits, kv = fn(
        params,
        cfg,
        jnp.asarray(ids),
        batch.positions,
        kv,
        batch.metadata,
        batch.last_token_indices,
        backend="cpu",
        matmul_backend=mb,
        **_lora_args(seqs, lora),
    )
    return np.asarray(logits), kv


def _prefilled(params, cfg, prompts, num_pages=64, spare=0):
    """A cache holding `prompts` (through the jnp layers), each on its own run of pages, and pages for `spare` more
    sequences."""
    kv = init_kv_cache(cfg, num_pages, PAGE)
    per = num_pages // (len(prompts) + spare)
    pages = [list(range(s * per, (s + 1) * per)) for s in range(len(prompts) + spare)]
    _, kv = _step(params, cfg, kv, [(p, 0, pg) for p, pg in zip(prompts, pages, strict=False)], "xla")
    return kv, pages


def _prompts(cfg, lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]


def _calls(params, cfg, kv, seqs, mb, lora=None) -> int:
    """Decode-layer kernel calls in the step's program."""
    ids = jnp.zeros(sum(len(t) for t, _, _ in seqs), jnp.int32)
    lens = [p + len(t) for t, p, _ in seqs]
    batch = paged.build_batch(
        lens, [len(t) for t, _, _ in seqs], [pg for _, _, pg in seqs], page_size=PAGE, num_pages=kv.num_pages
    )
    hlo = (
        jax.jit(forward, static_argnames=("cfg", "backend", "matmul_backend"))
        .lower(
            params,
            cfg,
            ids,
            batch.positions,
            kv,
            batch.metadata,
            backend="cpu",
            matmul_backend=mb,
            **_lora_args(seqs, lora),
        )
        .as_text()
    )
    return hlo.count(cpu_decode_layer.TARGET)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_decode_layers_give_the_jnp_layers_logits_and_pages(name):
    """Decodes beside a two-token run (a speculative verify) and a short prompt chunk: every token per token."""
    cfg, params = load_model(FIXTURES / name, "float32", cache=False)
    params = fuse_qkv(params)
    prompts = _prompts(cfg, [5, 23, 40])
    kv, pages = _prefilled(params, cfg, prompts, spare=1)
    nxt = _prompts(cfg, [1, 2, 1, 6], seed=1)
    seqs = [(nxt[0], 5, pages[0]), (nxt[1], 23, pages[1]), (nxt[2], 40, pages[2]), (nxt[3], 0, pages[3][:2])]
    assert _calls(params, cfg, kv, seqs, "cpu_rows") == cfg.num_layers
    assert _calls(params, cfg, kv, seqs, "xla") == 0
    want, kv_want = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "xla")
    got, kv_got = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "cpu_rows")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for a, b in zip(jax.tree.leaves(kv_got), jax.tree.leaves(kv_want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("others", [3, 11])
def test_a_tokens_logits_are_the_same_alone_and_in_a_batch(others):
    """3 others: the matmuls' row stream (4 rows), 11: their register tiles (12 rows); one context spans two
    1024-position parts of the attention."""
    name = "tiny-llama"
    cfg, params = load_model(FIXTURES / name, "float32", cache=False)
    params = fuse_qkv(params)
    lens = [1100] + [7 + 3 * i for i in range(others)]
    kv, pages = _prefilled(params, cfg, _prompts(cfg, lens), num_pages=(others + 1) * 72)
    nxt = _prompts(cfg, [1] * len(lens), seed=2)
    seqs = [(t, n, pg) for t, n, pg in zip(nxt, lens, pages, strict=True)]
    alone, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs[:1], "cpu_rows")
    together, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "cpu_rows")
    np.testing.assert_array_equal(alone[0], together[0])
    want, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "xla")
    np.testing.assert_allclose(together, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


LORA_BASES = {"tiny-llama": ("llama-all-r8", "llama-qv-r4", "llama-mlp-r16"), "tiny-qwen3": ("qwen3-all-r8",)}
LORA_BASES["tiny-gemma3"] = ("gemma3-all-r8",)


def _adapter_slots(cfg, names, num_slots=4, max_rank=16):
    """Slots 0.. holding the PEFT fixtures `names` (rank padded to max_rank), the rest empty."""
    slots = L.empty_slots(cfg, num_slots, max_rank)
    for s, name in enumerate(names):
        slots = L.set_slot(cfg, slots, s, L.load_peft_adapter(DATA / "lora" / name, cfg, max_rank=max_rank))
    return slots


@pytest.mark.parametrize(("name", "max_rank"), [(n, 16) for n in sorted(LORA_BASES)] + [("tiny-llama", 13)])
def test_decode_layers_with_adapters_give_the_jnp_layers_logits_and_pages(name, max_rank):
    """A step mixing tokens of several adapters, of an empty slot and of the base model (-1) runs every layer as one
    kernel call and gives the jnp layers' logits and pages (Gemma 3: sandwich norms, GELU, windows); rank 13 leaves
    part of a vector of ranks in every group (the kernel's scalar tails)."""
    cfg, params = load_model(FIXTURES / name, "float32", cache=False)
    params = fuse_qkv(params)
    prompts = _prompts(cfg, [5, 23, 40, 9])
    kv, pages = _prefilled(params, cfg, prompts, spare=1)
    nxt = _prompts(cfg, [1, 2, 1, 1, 6], seed=1)
    seqs = [(t, n, pg) for t, n, pg in zip(nxt, [5, 23, 40, 9, 0], pages, strict=True)]
    seqs[-1] = (nxt[-1], 0, pages[-1][:2])
    names = [a for a in LORA_BASES[name] if "r16" not in a or max_rank >= 16]
    lora = (_adapter_slots(cfg, names, max_rank=max_rank), [0, -1, len(names) - 1, 3, 0])
    assert _calls(params, cfg, kv, seqs, "cpu_rows", lora) == cfg.num_layers
    want, kv_want = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "xla", lora)
    got, kv_got = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "cpu_rows", lora)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for a, b in zip(jax.tree.leaves(kv_got), jax.tree.leaves(kv_want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    base, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "cpu_rows")
    assert np.abs(got[0] - base[0]).max() > 1e-3  # the adapter shows in the logits
    np.testing.assert_array_equal(got[1], base[1])  # the base model's token: no delta at all


def test_an_adapter_tokens_logits_do_not_depend_on_its_neighbours_adapters():
    """A token of adapter 0 gives the same bits alone, beside tokens of the other adapters, and beside base tokens."""
    cfg, params = load_model(FIXTURES / "tiny-llama", "float32", cache=False)
    params = fuse_qkv(params)
    lens = [30, 12, 17, 8, 21]
    kv, pages = _prefilled(params, cfg, _prompts(cfg, lens), num_pages=80)
    seqs = [(t, n, pg) for t, n, pg in zip(_prompts(cfg, [1] * 5, seed=3), lens, pages, strict=True)]
    slots = _adapter_slots(cfg, LORA_BASES["tiny-llama"])
    alone, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs[:1], "cpu_rows", (slots, [0]))
    for mix in ([0, 1, 2, 1, 2], [0, -1, -1, 0, 3], [0, 0, 0, 0, 0]):
        together, _ = _step(params, cfg, jax.tree.map(jnp.copy, kv), seqs, "cpu_rows", (slots, mix))
        np.testing.assert_array_equal(alone[0], together[0])


def test_layers_it_does_not_take_run_the_jnp_layer():
    """Unjoined q/k/v, int8 pages, mixture-of-experts layers and prefill-sized steps keep the jnp layer."""
    cfg, params = load_model(FIXTURES / "tiny-llama", "float32", cache=False)
    fused = fuse_qkv(params)
    kv = init_kv_cache(cfg, 8, PAGE)
    lp, k = fused["layers"][0], kv.k[0]
    assert cpu_decode_layer.takes(lp, cfg, 0, k, 1) and cpu_decode_layer.takes(lp, cfg, 0, k, 32)
    assert not cpu_decode_layer.takes(lp, cfg, 0, k, 33)
    assert not cpu_decode_layer.takes(params["layers"][0], cfg, 0, k, 1)
    assert not cpu_decode_layer.takes(lp, cfg, 0, init_kv_cache(cfg, 8, PAGE, jnp.int8).k[0], 1)
    assert not cpu_decode_layer.takes({**lp, "wo": lp["wo"].astype(jnp.bfloat16)}, cfg, 0, k, 1)
    assert cpu_decode_layer.takes(lp, cfg, 0, k, 1, L.empty_slots(cfg, 2, 8)[0])
    assert not cpu_decode_layer.takes(lp, cfg, 0, k, 1, L.empty_slots(cfg, 2, 8, jnp.bfloat16)[0])
    mcfg, mparams = load_model(FIXTURES / "tiny-qwen3-moe", "float32", cache=False)
    mkv = init_kv_cache(mcfg, 8, PAGE)
    moe = [i for i in range(mcfg.num_layers) if mcfg.is_moe_layer(i)]
    assert moe and not cpu_decode_layer.takes(fuse_qkv(mparams)["layers"][moe[0]], mcfg, moe[0], mkv.k[0], 1)


@pytest.mark.slow
def test_smollm2_reference_chats_greedy_as_the_xla_path(smollm2_path):
    """The engine with its decode layers as kernel calls (the CPU default) answers SmolLM2's reference chats with
    exactly the XLA path's greedy tokens, and the transformers reference's."""
    ref = reference("smollm2")["cases"]
    sp = SamplingParams(max_tokens=48, temperature=0)
    answers = {}
    for mb in ("xla", "cpu_rows"):
        llm = LLM(smollm2_path, dtype="float32", max_num_seqs=8, warmup=False, matmul_backend=mb)
        answers[mb] = [o.outputs[0].token_ids for o in llm.chat([c["messages"] for c in ref], sp, use_tqdm=False)]
        del llm
    assert answers["cpu_rows"] == answers["xla"]
    assert answers["cpu_rows"] == [c["greedy_ids"] for c in ref]
