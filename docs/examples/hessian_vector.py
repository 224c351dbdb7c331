"""Second derivatives: Hessian-vector products of a next-token loss with respect to the input embeddings, by
forward-over-reverse differentiation (`jax.jvp` of `jax.grad`) through `forward_dense`, the curvature along a random
direction and, by power iteration, the sharpest one, checked against a finite difference of the gradient
(python docs/examples/hessian_vector.py [MODEL])."""

import sys

import jax
import jax.numpy as jnp

from netra_jax import LLM
from netra_jax.models.transformer import embed_tokens, forward_dense

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None, dtype="float32")  # float32: finite differences need it
cfg, params = llm.model_config, llm.params
ids = jnp.asarray(llm.get_tokenizer().encode("Paris is the capital of France."), jnp.int32)  # [T]


def loss(embeds):  # mean next-token cross entropy as a function of the input embeddings [T, hidden]
    logits = forward_dense(params, cfg, embeds)  # [T, vocab]
    logp = jax.nn.log_softmax(logits[:-1])
    return -jnp.take_along_axis(logp, ids[1:, None], 1).mean()


grad = jax.jit(jax.grad(loss))  # [T, hidden]


@jax.jit
def hvp(embeds, v):  # H v: the derivative of the gradient along v (forward mode over reverse mode)
    return jax.jvp(jax.grad(loss), (embeds,), (v,))[1]


embeds = embed_tokens(params, cfg, ids)
v = jax.random.normal(jax.random.key(0), embeds.shape, embeds.dtype)
v = v / jnp.linalg.norm(v)
hv = hvp(embeds, v)
curvature = float(jnp.vdot(v, hv))  # v.Hv: the second derivative of the loss along v
print(f"curvature along a random direction: {curvature:.6f}; |Hv| = {float(jnp.linalg.norm(hv)):.6f}")

# the sharpest direction (largest |eigenvalue| of the Hessian) by power iteration: one Hessian-vector product a step
u = v
for _ in range(20):
    hu = hvp(embeds, u)
    u = hu / jnp.linalg.norm(hu)
sharpest = float(jnp.vdot(u, hvp(embeds, u)))
print(f"sharpest curvature (20 steps of power iteration): {sharpest:.6f}")
print("its weight per token:", [round(float(x), 4) for x in jnp.linalg.norm(u, axis=-1)])

# checked: a central finite difference of the (reverse-mode) gradient along v
eps = 1e-2
fd = (grad(embeds + eps * v) - grad(embeds - eps * v)) / (2 * eps)
error = float(jnp.linalg.norm(hv - fd) / jnp.linalg.norm(hv))
print(f"Hv against the finite difference of the gradient: relative error {error:.2e}")
assert error <= 1e-2
