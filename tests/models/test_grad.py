"""Differentiation through the model: attention's dense backward against finite differences of the paged reference,
the dense reference against the paged one, `jax.grad` of a next-token loss against finite differences and against
torch autograd (tests/fixtures/grad_reference.npz), the same gradients through the interpreted Pallas kernels,
`forward_dense` against transformers' logits and `forward`, and `input_embeds` against token ids."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import MIXED, SINKS, make_case
from support.checkpoints import DATA, FIXTURES, reference

from netra_jax.config import ModelConfig
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.transformer import embed_tokens, forward, forward_dense, init_kv_cache
from netra_jax.models.weight_map import LINEAR, hf_names, hf_to_params, table
from netra_jax.ops.attention import AttentionMetadata, attention, paged_attention_dense, paged_attention_reference

GRAD_REFERENCE = DATA / "grad_reference.npz"
TORCH_MODELS = ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"]  # as make_grad_reference.py's WEIGHTS


@functools.cache
def load(name: str) -> tuple[ModelConfig, dict]:
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    ck = HFCheckpoint(FIXTURES / name)
    return cfg, jax.tree.map(jnp.asarray, hf_to_params(cfg, ck.get, ck.has, np.float32))


def prompt(name: str, case: int = 0) -> jax.Array:
    return jnp.asarray(reference(name)["cases"][case]["prompt_ids"], jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def next_token_loss(params, x, ids, *, cfg, backend="reference"):
    """Mean cross entropy of the logits at positions 0..T-2 against tokens 1..T-1; x: ids or embeddings."""
    logp = jax.nn.log_softmax(forward_dense(params, cfg, x, backend=backend)[:-1])  # [T-1, vocab]
    return -jnp.take_along_axis(logp, ids[1:, None], axis=1).mean()


def grad_fn(cfg, backend="reference"):
    """(loss, (d params, d embeddings)) of the next-token loss at (params, embeddings, ids), jitted."""
    loss = functools.partial(next_token_loss, cfg=cfg, backend=backend)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x)))


def assert_directional_derivatives(f, x, grad, *, key, h=3e-3, rtol=1e-2, n=3):
    """grad . d against central differences (f(x + h d) - f(x - h d)) / 2h along n random directions d, each
    element normal times its leaf's RMS (parameters of every scale move alike). Float32 losses: the error is measured
    against the typical size of grad . d over such directions, the norm of grad times each leaf's RMS."""
    leaves, tree = jax.tree.flatten(x)
    g = tree.flatten_up_to(grad)
    typical = float(jnp.sqrt(sum(jnp.sum(jnp.square(gl * rms(xl))) for gl, xl in zip(g, leaves, strict=True))))
    for k in jax.random.split(key, n):
        keys = jax.random.split(k, len(leaves))
        d = [jax.random.normal(kl, xl.shape) * rms(xl) for kl, xl in zip(keys, leaves, strict=True)]
        plus, minus = (tree.unflatten([xl + s * h * dl for xl, dl in zip(leaves, d, strict=True)]) for s in (1, -1))
        want = float(f(plus) - f(minus)) / (2 * h)
        got = float(sum(jnp.vdot(gl, dl) for gl, dl in zip(g, d, strict=True)))
        assert abs(got - want) <= rtol * typical, (got, want, typical)


# ------------------------------------------------------------------------------------------------ attention


ATTENTION_CASES = {
    "plain": {},
    "window_softcap": dict(sliding_window=9, soft_cap=2.0),
    "sinks_window_softcap": dict(sliding_window=9, soft_cap=2.0, sinks=True),
}
# a ragged batch (with padding sequences), and one sequence alone (the dense reference gathers its keys once)
BATCHES = {"batch": (MIXED, 2), "one_sequence": ([(20, 30)], 0)}


def _attention_case(kw, batch="batch", dtype=jnp.float32, D=32):
    seqs, pad_seqs = BATCHES[batch]
    q, k, v, md = make_case(seqs, P=16, KH=2, G=2, D=D, dtype=dtype, pad_tokens=3, pad_seqs=pad_seqs)
    sinks = jnp.asarray(SINKS[:4]) if kw.get("sinks") else None
    return (q, k, v, sinks), md, {**kw, "sinks": sinks, "scale": D**-0.5}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kw", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_dense_attention_matches_paged_reference(kw, batch):
    (q, k, v, _), md, kw = _attention_case(kw, batch)
    want = paged_attention_reference(q, k, v, md, **kw)
    got = paged_attention_dense(q, k, v, md, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    assert not np.asarray(got)[int(md.query_start_loc[-1]) :].any(), "padding tokens must give zeros"


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kw", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_grad_matches_finite_differences(kw, batch):
    """The backward (the dense reference's VJP) against central differences of the paged reference's forward, in
    q, k_pages, v_pages (and sinks); a nonlinear readout so that the cotangent depends on the output."""
    args, md, kw = _attention_case(kw, batch)
    w = jax.random.normal(jax.random.key(1), args[0].shape)

    @jax.jit
    def loss(args):
        q, k, v, sinks = args
        o = attention(q, k, v, md, **{**kw, "sinks": sinks})
        return jnp.tanh(o * w).sum()

    @jax.jit
    def loss_reference(args):  # the same without the custom backward: forward only
        q, k, v, sinks = args
        return jnp.tanh(paged_attention_reference(q, k, v, md, **{**kw, "sinks": sinks}) * w).sum()

    grad = jax.grad(loss)(args)
    assert jax.tree.structure(grad) == jax.tree.structure(args)  # a sinks gradient exactly when there are sinks
    assert_directional_derivatives(loss_reference, args, grad, key=jax.random.key(2))


@pytest.mark.parametrize("backend", ["triton_interpret", "mosaic_interpret"])
def test_attention_grad_through_interpreted_kernels(backend):
    """Reverse mode through a Pallas kernel (its forward, the dense backward) equals it through the reference.
    bfloat16 and head_dim 64: shapes the Mosaic kernel takes."""
    (q, k, v, sinks), md, kw = _attention_case(ATTENTION_CASES["sinks_window_softcap"], dtype=jnp.bfloat16, D=64)
    w = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)

    def grads(backend):
        def loss(q, k, v, sinks):
            o = attention(q, k, v, md, **{**kw, "sinks": sinks}, backend=backend)
            return jnp.tanh(o.astype(jnp.float32) * w).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    for got, want in zip(grads(backend), grads("reference"), strict=True):
        assert got.dtype == want.dtype
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2 * scale)


def test_unknown_backend_is_refused():
    (q, k, v, _), md, kw = _attention_case({})
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        attention(q, k, v, md, **kw, backend="nope")


# ------------------------------------------------------------------------------------------------ model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_model_grad_matches_finite_differences(name):
    cfg, params = load(name)
    ids = prompt(name)
    x = embed_tokens(params, cfg, ids)
    _, (g_params, g_x) = grad_fn(cfg)(params, x, ids)
    loss = functools.partial(next_token_loss, ids=ids, cfg=cfg)
    assert_directional_derivatives(jax.jit(lambda p: loss(p, x)), params, g_params, key=jax.random.key(3))
    assert_directional_derivatives(jax.jit(lambda e: loss(params, e)), x, g_x, key=jax.random.key(4))


def _torch_grad(cfg: ModelConfig, g_params: dict, hf_name: str) -> np.ndarray:
    """Our gradient of the parameter read from HF tensor `hf_name`, laid out as HF's ([out, in] for linears)."""
    for entry in table(cfg):
        for layer in [None] if "{L}" not in entry.hf[0] else range(cfg.num_layers):
            if hf_names(entry, cfg, layer) == [[hf_name]]:
                g = g_params[entry.param] if layer is None else g_params["layers"][layer][entry.param]
                return np.asarray(g).T if entry.transform == LINEAR else np.asarray(g)
    raise KeyError(hf_name)


@pytest.mark.parametrize("name", TORCH_MODELS)
def test_model_grad_matches_torch(name):
    ref = np.load(GRAD_REFERENCE)
    cfg, params = load(name)
    ids = prompt(name)
    np.testing.assert_array_equal(np.asarray(ids), ref[f"{name}/prompt_ids"])
    loss, (g_params, g_x) = grad_fn(cfg)(params, embed_tokens(params, cfg, ids), ids)
    np.testing.assert_allclose(float(loss), ref[f"{name}/loss"], rtol=1e-5)
    want = ref[f"{name}/inputs_embeds_grad"]
    np.testing.assert_allclose(np.asarray(g_x), want, atol=1e-5 * np.abs(want).max(), rtol=1e-4)
    weights = [k.split("/", 1)[1] for k in ref.files if k.startswith(f"{name}/model.")]
    assert len(weights) == 4
    for w in weights:
        want = ref[f"{name}/{w}"]
        got = _torch_grad(cfg, g_params, w)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-4, err_msg=w)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt-oss"])
def test_model_grad_through_triton_interpret(name):
    """The fixtures' float32 shapes run on the interpreted Triton kernel (the Mosaic one takes bfloat16/float16 and
    head_dim multiples of 64 only: covered by the attention-level test)."""
    cfg, params = load(name)
    ids = prompt(name)
    x = embed_tokens(params, cfg, ids)
    want_loss, want = grad_fn(cfg)(params, x, ids)
    got_loss, got = grad_fn(cfg, "triton_interpret")(params, x, ids)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(jnp.abs(b).max()) + 1e-9)


# ------------------------------------------------------------------------------------------------ forward_dense


def _paged_forward(params, cfg, ids=None, embeds=None, page_size=8):
    """`forward` on a cache of its own (page size 8, pages in reverse order, no work lists: every token per token)."""
    T = (ids if ids is not None else embeds).shape[0]
    pages = -(-T // page_size) + 1
    bt = jnp.arange(pages, dtype=jnp.int32)[::-1]
    md = AttentionMetadata(
        slot_mapping=bt[jnp.arange(T) // page_size] * page_size + jnp.arange(T) % page_size,
        query_start_loc=jnp.array([0, T], jnp.int32),
        seq_lens=jnp.array([T], jnp.int32),
        block_tables=bt[None],
    )
    kv = init_kv_cache(cfg, pages, page_size)
    logits, _ = forward(params, cfg, ids, jnp.arange(T, dtype=jnp.int32), kv, md, input_embeds=embeds)
    return logits


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"])
def test_forward_dense_matches_transformers_and_forward(name):
    cfg, params = load(name)
    fd = jax.jit(forward_dense, static_argnames=("cfg", "backend"))
    for case in reference(name)["cases"][:2]:
        ids = jnp.asarray(case["prompt_ids"], jnp.int32)
        got = np.asarray(fd(params, cfg, ids))
        assert got.dtype == np.float32 and got.shape == (ids.shape[0], cfg.vocab_size)
        np.testing.assert_allclose(got, np.asarray(case["logits"]), atol=1e-4)
        np.testing.assert_allclose(got, np.asarray(_paged_forward(params, cfg, ids)), atol=1e-5)


def test_forward_dense_vmaps_over_a_batch():
    """Logits and gradients of a batch under vmap equal those of its sequences one by one (a dense model; MoE
    models: tests/models/test_moe_vmap.py)."""
    cfg, params = load("tiny-gemma3")
    ids = prompt("tiny-gemma3")
    batch = jnp.stack([ids, ids[::-1]])  # [2, T]
    got = jax.jit(jax.vmap(lambda x: forward_dense(params, cfg, x)))(batch)
    for row, x in zip(got, batch, strict=True):
        np.testing.assert_allclose(np.asarray(row), np.asarray(forward_dense(params, cfg, x)), atol=1e-5)
    batched = jax.jit(jax.grad(lambda p: jax.vmap(lambda x: next_token_loss(p, x, x, cfg=cfg))(batch).sum()))
    one = jax.grad(lambda p, x: next_token_loss(p, x, x, cfg=cfg))
    want = jax.tree.map(jnp.add, one(params, batch[0]), one(params, batch[1]))
    for a, b in zip(jax.tree.leaves(batched(params)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(jnp.abs(b).max()) + 1e-9)


def test_forward_dense_refuses_bad_input():
    cfg, params = load("tiny-llama")
    for bad in (jnp.zeros((3, 2), jnp.int32), jnp.zeros((3,), jnp.float32), jnp.zeros((0,), jnp.int32)):
        with pytest.raises(ValueError, match="token ids"):
            forward_dense(params, cfg, bad)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])  # tiny-gemma3: the sqrt(hidden) embedding scale
def test_input_embeds_equal_token_ids(name):
    cfg, params = load(name)
    ids = prompt(name, 1)
    x = embed_tokens(params, cfg, ids)
    scale = cfg.hidden_size**0.5 if cfg.scale_embeddings else 1.0
    np.testing.assert_allclose(np.asarray(x), np.asarray(params["embed"][ids]) * scale, rtol=1e-6)
    want = np.asarray(reference(name)["cases"][1]["logits"])
    np.testing.assert_allclose(np.asarray(_paged_forward(params, cfg, embeds=x)), want, atol=1e-4)
    np.testing.assert_allclose(
        np.asarray(_paged_forward(params, cfg, embeds=x)), np.asarray(_paged_forward(params, cfg, ids)), atol=1e-6
    )
    np.testing.assert_allclose(np.asarray(forward_dense(params, cfg, x)), np.asarray(forward_dense(params, cfg, ids)))
    with pytest.raises(ValueError, match="exactly one of token_ids and input_embeds"):
        _paged_forward(params, cfg, ids, x)
    with pytest.raises(ValueError, match="input_embeds must be"):
        _paged_forward(params, cfg, embeds=x[:, :-1])
