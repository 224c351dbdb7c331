"""Forward-mode differentiation through the model and its attention: `jax.jvp`, `jax.linearize`, `jax.jacfwd` and a
forward-over-reverse Hessian-vector product (`jax.jvp` of `jax.grad`) of a next-token loss through `forward_dense`,
in the parameters and in the input embeddings, against central finite differences (float32, Richardson-extrapolated),
on the "reference" and "cpu" attention backends; attention's tangent on every case and through the interpreted
Pallas kernels and over an int8 cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import MIXED, SINKS, make_case
from support.checkpoints import FIXTURES, reference

from netra_jax.config import ModelConfig
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.transformer import embed_tokens, forward_dense
from netra_jax.models.weight_map import hf_to_params
from netra_jax.ops.attention import attention, paged_attention_reference
from netra_jax.ops.kv_quant import QuantizedPages, quantize

# dense; sliding window, soft-caps and sandwich norms; attention sinks and mixture-of-experts layers
MODELS = ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"]
BACKENDS = ["reference", "cpu"]
RTOL = 1e-3
# finite-difference steps along directions whose elements are normal times their leaf's RMS: float32 rounding of the
# loss over the step is the error; the parameters' step stays small enough that no MoE routing flips within it
STEPS = {"params": 1e-2, "embeds": 3e-2}


def tree_norm(t) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(t)))


def tree_vdot(a, b) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def axpy(a, d, y):
    """y + a d, leaf by leaf."""
    return jax.tree.map(lambda yl, dl: yl + a * dl, y, d)


def finite_difference(f, h):
    """d/dt f(t) at 0 (f: scalar -> pytree) by central differences, Richardson-extrapolated over steps h and h/2
    (error O(h^4), so the step can stay large against float32 rounding)."""

    def central(h):
        return jax.tree.map(lambda a, b: (a - b) / (2 * h), f(h), f(-h))

    return jax.tree.map(lambda fine, coarse: (4 * fine - coarse) / 3, central(h / 2), central(h))


def typical(grad, d) -> float:
    """The typical size of grad . d over directions like d (each leaf normal times its scale): the norm of grad times
    each leaf's RMS in d. A float32 difference quotient's error is measured against it, not against one direction's
    value, which may be near zero."""
    return float(tree_norm(jax.tree.map(lambda g, dl: g * jnp.sqrt(jnp.mean(jnp.square(dl))), grad, d)))


def assert_close(got, want, rtol=RTOL):
    """got and want (pytrees) equal up to rtol of want's norm."""
    err, scale = float(tree_norm(jax.tree.map(jnp.subtract, got, want))), float(tree_norm(want))
    assert err <= rtol * scale, (err, scale)


class Case:
    """A fixture model on one attention backend: its parameters and the embeddings of a prompt (the primals),
    directions in the parameters and in the embeddings, and the jitted derivatives of its mean next-token loss."""

    def __init__(self, name: str, backend: str):
        cfg = ModelConfig.from_hf_dir(FIXTURES / name)
        ck = HFCheckpoint(FIXTURES / name)
        params = jax.tree.map(jnp.asarray, hf_to_params(cfg, ck.get, ck.has, np.float32))
        ids = jnp.asarray(reference(name)["cases"][0]["prompt_ids"], jnp.int32)  # [T]
        self.primals = (params, embed_tokens(params, cfg, ids))  # (params, embeddings [T, hidden])

        def token_losses(primals):  # [T - 1] cross entropy of each next token
            logits = forward_dense(primals[0], cfg, primals[1], backend=backend)  # [T, vocab]
            return -jnp.take_along_axis(jax.nn.log_softmax(logits[:-1]), ids[1:, None], axis=1)[:, 0]

        def loss(primals):
            return token_losses(primals).mean()

        zero = jax.tree.map(jnp.zeros_like, self.primals)
        dp, dx = (self._direction(jax.random.key(k), t) for k, t in enumerate(self.primals))
        self.directions = {"params": (dp, zero[1]), "embeds": (zero[0], dx)}
        self.loss = jax.jit(loss)
        self.jvp = jax.jit(lambda primals, d: jax.jvp(loss, (primals,), (d,)))  # (loss, d loss . d)
        # forward over reverse: ((loss, gradient), (d loss . d, Hessian . d))
        self.hvp = jax.jit(lambda primals, d: jax.jvp(jax.value_and_grad(loss), (primals,), (d,)))

        def along(s):  # token losses at primals + s[0] (params direction) + s[1] (embeddings direction)
            moved = axpy(s[0], self.directions["params"], axpy(s[1], self.directions["embeds"], self.primals))
            losses = token_losses(moved)
            return losses, losses

        self.jacfwd = jax.jit(jax.jacfwd(along, has_aux=True))  # s [2] -> (Jacobian [T - 1, 2], losses [T - 1])

    @staticmethod
    def _direction(key, tree):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(key, len(leaves))
        rms = [jnp.sqrt(jnp.mean(jnp.square(a))) for a in leaves]
        return treedef.unflatten([jax.random.normal(k, a.shape) * r for k, a, r in zip(keys, leaves, rms, strict=True)])


@functools.cache
def case(name: str, backend: str) -> Case:
    return Case(name, backend)


PARAMS = [(m, b) for m in MODELS for b in BACKENDS]
IDS = [f"{m}-{b}" for m, b in PARAMS]


@pytest.mark.parametrize(("name", "backend"), PARAMS, ids=IDS)
def test_jvp_linearize_and_grad_match_finite_differences(name, backend):
    c = case(name, backend)
    for wrt, d in c.directions.items():
        want = finite_difference(lambda h, d=d: c.jvp(axpy(h, d, c.primals), d)[0], STEPS[wrt])
        value, tangent = c.jvp(c.primals, d)
        (value_r, grad), _ = c.hvp(c.primals, d)
        scale = typical(grad, d)
        assert abs(float(tangent - want)) <= RTOL * scale, (wrt, float(tangent), float(want), scale)
        assert abs(float(tree_vdot(grad, d) - want)) <= RTOL * scale, (wrt, float(tree_vdot(grad, d)), float(want))
        lin_value, f_jvp = jax.linearize(c.loss, c.primals)
        np.testing.assert_allclose(float(lin_value), float(value), rtol=1e-6, err_msg=wrt)
        np.testing.assert_allclose(float(value_r), float(value), rtol=1e-6, err_msg=wrt)
        np.testing.assert_allclose(float(f_jvp(d)), float(tangent), rtol=1e-5, err_msg=wrt)


@pytest.mark.parametrize(("name", "backend"), PARAMS, ids=IDS)
def test_hessian_vector_product_matches_finite_differences_of_the_gradient(name, backend):
    """Hessian . d by forward over reverse against central differences of the (reverse-mode) gradient along d."""
    c = case(name, backend)
    for wrt, d in c.directions.items():
        (_, grad), (d_loss, hvp) = c.hvp(c.primals, d)
        assert jax.tree.structure(hvp) == jax.tree.structure(c.primals)
        want = finite_difference(lambda h, d=d: c.hvp(axpy(h, d, c.primals), d)[0][1], STEPS[wrt] / 3)
        assert_close(hvp, want)
        np.testing.assert_allclose(float(d_loss), float(tree_vdot(grad, d)), rtol=1e-4)


@pytest.mark.parametrize(("name", "backend"), PARAMS, ids=IDS)
def test_jacfwd_matches_finite_differences(name, backend):
    """The Jacobian of the per-token losses along the parameter and embedding directions, column by column."""
    c = case(name, backend)
    jac, losses = c.jacfwd(jnp.zeros(2))
    assert jac.shape == (losses.shape[0], 2)
    for i, wrt in enumerate(c.directions):
        want = finite_difference(lambda h, i=i: c.jacfwd(jnp.zeros(2).at[i].set(h))[1], STEPS[wrt])
        assert_close(jac[:, i], want)


# ------------------------------------------------------------------------------------------------ attention

ATTENTION_CASES = {
    "plain": {},
    "window_softcap": dict(sliding_window=9, soft_cap=2.0),
    "sinks_window_softcap": dict(sliding_window=9, soft_cap=2.0, sinks=True),
}


def _attention_case(kw, dtype=jnp.float32, D=32):
    q, k, v, md = make_case(MIXED, P=16, KH=2, G=2, D=D, dtype=dtype, pad_tokens=3, pad_seqs=2)
    sinks = jnp.asarray(SINKS[:4]) if kw.get("sinks") else None
    return (q, k, v, sinks), md, {**kw, "sinks": sinks, "scale": D**-0.5}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_jvp_matches_finite_differences(kw, backend):
    """The tangent (the dense reference's) against central differences of the paged reference's forward, in q,
    k_pages, v_pages and sinks at once; the primal output is the backend's own."""
    args, md, kw = _attention_case(kw)
    keys = jax.random.split(jax.random.key(1), 4)
    d = tuple(None if a is None else jax.random.normal(key, a.shape) for key, a in zip(keys, args, strict=True))

    def run(fn, args):
        q, k, v, sinks = args
        return fn(q, k, v, md, **{**kw, "sinks": sinks})

    out, tangent = jax.jit(jax.jvp, static_argnums=0)(
        lambda a: run(functools.partial(attention, backend=backend), a), (args,), (d,)
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(run(paged_attention_reference, args)), atol=1e-5)
    reference_at = jax.jit(lambda h: run(paged_attention_reference, axpy(h, d, args)))
    assert_close(tangent, finite_difference(reference_at, 1e-2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_jvp_over_an_int8_cache(backend):
    """Over quantized pages the tangent flows through q and the pages' scales (the int8 values have none), as the
    dense reference de-quantizes them: against central differences of the paged reference."""
    (q, k, v, sinks), md, kw = _attention_case(ATTENTION_CASES["sinks_window_softcap"])
    kq, vq = (QuantizedPages(*quantize(a, jnp.int8)) for a in (k, v))
    keys = jax.random.split(jax.random.key(3), 3)
    # each element moved in proportion to its size (a scale of 0.02 by 0.02 a unit step)
    dq, dks, dvs = (jax.random.normal(key, a.shape) * a for key, a in zip(keys, (q, kq.scales, vq.scales), strict=True))

    def run(fn, q, k_scales, v_scales):
        return fn(q, kq.replace(scales=k_scales), vq.replace(scales=v_scales), md, **kw)

    att = functools.partial(attention, backend=backend)
    _, tangent = jax.jit(lambda *a: jax.jvp(lambda *p: run(att, *p), a, (dq, dks, dvs)))(q, kq.scales, vq.scales)
    moved = jax.jit(lambda h: run(paged_attention_reference, q + h * dq, kq.scales + h * dks, vq.scales + h * dvs))
    assert_close(tangent, finite_difference(moved, 1e-2))


@pytest.mark.parametrize("backend", ["triton_interpret", "mosaic_interpret"])
def test_attention_jvp_through_interpreted_kernels(backend):
    """Forward mode through a Pallas kernel (its forward, the dense tangent) equals it through the reference.
    bfloat16 and head_dim 64: shapes the Mosaic kernel takes."""
    args, md, kw = _attention_case(ATTENTION_CASES["sinks_window_softcap"], dtype=jnp.bfloat16, D=64)
    d = jax.tree.map(lambda a: jnp.ones_like(a) / 4, args)

    def jvp(backend):
        def f(q, k, v, sinks):
            return attention(q, k, v, md, **{**kw, "sinks": sinks}, backend=backend)

        return jax.jit(lambda args, d: jax.jvp(f, args, d))(args, d)

    for got, want in zip(jvp(backend), jvp("reference"), strict=True):
        assert got.dtype == want.dtype == jnp.bfloat16
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2 * scale)
