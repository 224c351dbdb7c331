"""vmap through mixture-of-experts layers: the grouped matmul's batching rule (a batch of row sets, each with its own
group sizes, as one call; a batch of weights as a loop) and its derivatives under vmap against single calls and
float64 numpy; `jax.vmap(forward_dense)` and per-example gradients (`jax.vmap(jax.grad(...))`) in the parameters
and in the embeddings on the MoE fixtures, float and int8 experts, against a Python loop of single calls; lowered for
an (abstract) H200, a batch runs the Pallas kernel once per grouped matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import TRITON_DEPRECATION
from support.checkpoints import FIXTURES, MOE_MODELS, reference

from netra_jax.config import ModelConfig
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.moe import MOE_KEYS, expert_matmul, grouped_matmul, moe_mlp
from netra_jax.models.transformer import embed_tokens, forward_dense
from netra_jax.models.weight_map import hf_to_params
from netra_jax.quant import quantize_params, quantize_weight

G, K, N, R, B = 4, 24, 40, 19, 3


def _grouped_case(seed=0):
    """B row sets [B, R, K] with their own group sizes [B, G] (one with an empty group, one all in one group)."""
    rng = np.random.default_rng(seed)
    sizes = np.stack([np.bincount(rng.integers(0, G, R), minlength=G) for _ in range(B - 1)] + [np.eye(G)[2] * R])
    rows = rng.standard_normal((B, R, K)).astype(np.float32)
    w = rng.standard_normal((G, K, N)).astype(np.float32)
    return jnp.asarray(rows), jnp.asarray(w), jnp.asarray(sizes.astype(np.int32))


def _float64(rows, w, sizes):
    """Each row times its group's matrix, in float64 numpy. rows [R, K], w [G, K, N], sizes [G]."""
    group = np.repeat(np.arange(G), np.asarray(sizes))
    return np.einsum("rk,rkn->rn", np.asarray(rows, np.float64), np.asarray(w, np.float64)[group])


def test_grouped_matmul_vmaps_over_row_sets_and_weights():
    rows, w, sizes = _grouped_case()
    want = np.stack([_float64(rows[b], w, sizes[b]) for b in range(B)])
    got = jax.jit(jax.vmap(grouped_matmul, in_axes=(0, None, 0)))(rows, w, sizes)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # one group layout for every row set; one matrix set per example (a loop)
    got = jax.vmap(grouped_matmul, in_axes=(0, None, None))(rows, w, sizes[0])
    np.testing.assert_allclose(np.asarray(got), np.stack([_float64(r, w, sizes[0]) for r in rows]), atol=1e-5)
    ws = jnp.stack([w, -w, 2 * w])
    got = jax.vmap(grouped_matmul, in_axes=(0, 0, 0))(rows, ws, sizes)
    want = np.stack([_float64(rows[b], ws[b], sizes[b]) for b in range(B)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_derivatives_under_vmap():
    """Per-example gradients in rows and w, and jacfwd in rows, equal single calls' (whose derivatives are the float64
    product's: the result is linear in each)."""
    rows, w, sizes = _grouped_case(1)
    ct = jax.random.normal(jax.random.key(0), (R, N))

    def loss(rows, w, sizes):
        return jnp.vdot(grouped_matmul(rows, w, sizes), ct)

    grad = jax.grad(loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(0, None, 0)))(rows, w, sizes)
    for b in range(B):
        group = np.repeat(np.arange(G), np.asarray(sizes[b]))
        d_rows = np.einsum("rn,rkn->rk", np.asarray(ct, np.float64), np.asarray(w, np.float64)[group])
        d_w = np.zeros((G, K, N))
        np.add.at(d_w, group, np.einsum("rk,rn->rkn", np.asarray(rows[b], np.float64), np.asarray(ct, np.float64)))
        np.testing.assert_allclose(np.asarray(got[0][b]), d_rows, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1][b]), d_w, rtol=1e-5, atol=1e-5)
    jac = jax.jit(jax.jacfwd(lambda r: grouped_matmul(r, w, sizes[0])))(rows[0][:5])  # [5, N, 5, K]
    group = np.repeat(np.arange(G), np.asarray(sizes[0]))[:5]
    np.testing.assert_allclose(np.asarray(jac[np.arange(5), :, np.arange(5)]), np.asarray(w)[group].transpose(0, 2, 1))


def test_quantized_experts_vmap():
    """int8 experts (values widened per group, scales after) under vmap equal single calls."""
    rows, w, sizes = _grouped_case(2)
    q = quantize_weight(w, "int8", 1)
    expert = jax.vmap(lambda s: jnp.repeat(jnp.arange(G), s, total_repeat_length=R))(sizes)  # [B, R]
    got = jax.jit(jax.vmap(expert_matmul, in_axes=(0, None, 0, 0)))(rows, q, sizes, expert)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(expert_matmul(rows[b], q, sizes[b], expert[b])))


# ------------------------------------------------------------------------------------------------ models


@functools.cache
def load(name: str, quantization: str | None = None) -> tuple[ModelConfig, dict]:
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    ck = HFCheckpoint(FIXTURES / name)
    params = jax.tree.map(jnp.asarray, hf_to_params(cfg, ck.get, ck.has, np.float32))
    return cfg, params if quantization is None else quantize_params(params, quantization)


def _batch(name: str) -> jax.Array:
    """The fixture's prompts cut to one length: [B, T] token ids."""
    prompts = [c["prompt_ids"] for c in reference(name)["cases"]][:B]
    T = min(len(p) for p in prompts)
    return jnp.asarray([p[:T] for p in prompts], jnp.int32)


def _assert_trees_close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=rtol * float(jnp.abs(b).max()) + 1e-9)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_forward_dense_vmaps_over_a_batch(name):
    cfg, params = load(name)
    batch = _batch(name)
    fd = jax.jit(forward_dense, static_argnames=("cfg",))
    got = jax.jit(jax.vmap(lambda x: forward_dense(params, cfg, x)))(batch)  # [B, T, vocab]
    for row, x in zip(got, batch, strict=True):
        np.testing.assert_allclose(np.asarray(row), np.asarray(fd(params, cfg, x)), atol=1e-5)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_per_example_gradients(name):
    """jax.vmap(jax.grad(loss)) in the parameters and in the embeddings, against a loop of single gradients."""
    cfg, params = load(name)
    batch = _batch(name)

    def loss(params, embeds, ids):  # mean next-token cross entropy
        logp = jax.nn.log_softmax(forward_dense(params, cfg, embeds)[:-1])
        return -jnp.take_along_axis(logp, ids[1:, None], axis=1).mean()

    embeds = jax.vmap(lambda ids: embed_tokens(params, cfg, ids))(batch)  # [B, T, hidden]
    grad = jax.grad(loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(None, 0, 0)))(params, embeds, batch)
    one = jax.jit(grad)
    for b in range(B):
        _assert_trees_close(jax.tree.map(lambda a, b=b: a[b], got), one(params, embeds[b], batch[b]))


def test_forward_dense_vmaps_with_int8_experts():
    cfg, params = load("tiny-qwen3-moe", "int8")
    batch = _batch("tiny-qwen3-moe")
    got = jax.jit(jax.vmap(lambda x: forward_dense(params, cfg, x)))(batch)
    for row, x in zip(got, batch, strict=True):
        np.testing.assert_allclose(np.asarray(row), np.asarray(forward_dense(params, cfg, x)), atol=1e-5)


@pytest.mark.filterwarnings(f"ignore:{TRITON_DEPRECATION}")
def test_gpu_lowering_of_a_batch_runs_the_kernel_once_per_grouped_matmul():
    """vmap of the MoE MLP, and its per-example gradients, lowered for CUDA: the batch's rows go through the Pallas
    grouped-matmul kernel in one call each for gate/up and down (no loop over the batch, no ragged_dot); the
    derivatives are the masked products."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    cfg, params = load("tiny-gpt-oss")
    lp = {k: v for k, v in params["layers"][1].items() if k in MOE_KEYS}
    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    x = jax.ShapeDtypeStruct((B, 16, cfg.hidden_size), jnp.bfloat16)
    lp = jax.tree.map(lambda a: a.astype(jnp.bfloat16), lp)
    forward = jax.vmap(lambda x, lp: moe_mlp(x, lp, cfg), in_axes=(0, None))
    grads = jax.vmap(jax.grad(lambda x, lp: moe_mlp(x, lp, cfg).astype(jnp.float32).sum(), (0, 1)), in_axes=(0, None))
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=gpu)):
        for fn in (forward, grads):
            text = jax.jit(fn).trace(x, lp).lower(lowering_platforms=("cuda",)).as_text()
            assert "ragged_dot" not in text and "stablehlo.while" not in text
            assert text.count("custom_call @__gpu$xla.gpu.triton") == 2
