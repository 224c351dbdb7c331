"""Gradients through the model: `jax.grad` of a next-token loss with respect to the weights and to the input
embeddings, with `forward_dense` (no cache argument), checked against a finite difference
(python docs/examples/gradients.py [MODEL])."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax import LLM
from netra_jax.models.transformer import embed_tokens, forward_dense

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg, params = llm.model_config, llm.params
ids = jnp.asarray(llm.get_tokenizer().encode("Paris is the capital of France."), jnp.int32)  # [T]


def loss(params, embeds):  # mean next-token cross entropy
    logits = forward_dense(params, cfg, embeds)  # [T, vocab]
    logp = jax.nn.log_softmax(logits[:-1])
    return -jnp.take_along_axis(logp, ids[1:, None], 1).mean()


embeds = embed_tokens(params, cfg, ids)  # [T, hidden], the embedding layer's output
value, (g_params, g_embeds) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, embeds)
print(f"loss {float(value):.4f}; |d loss / d embeds| {float(jnp.linalg.norm(g_embeds)):.4f}")
saliency = jnp.linalg.norm(g_embeds, axis=-1)  # [T] how much each input token moves the loss
print("token saliency:", np.round(np.asarray(saliency), 4).tolist())

# checked: a central finite difference along a random direction of the last layer's MLP weights
w = params["layers"][-1]["w_down"]
d = jax.random.normal(jax.random.key(0), w.shape, w.dtype)
d = d / jnp.linalg.norm(d)


def loss_along(eps):
    shifted = params.unfreeze()  # plain dicts and lists over the same arrays (llm.params is read-only)
    shifted["layers"][-1] = {**shifted["layers"][-1], "w_down": w + eps * d}
    return loss(shifted, embeds)


eps = 1e-2
fd = (loss_along(eps) - loss_along(-eps)) / (2 * eps)
ad = jnp.vdot(g_params["layers"][-1]["w_down"], d)
print(f"directional derivative: autodiff {float(ad):.6f}, finite difference {float(fd):.6f}")
assert abs(float(ad) - float(fd)) <= 1e-2 * max(1.0, abs(float(fd)))
