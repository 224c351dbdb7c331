"""Gradients with respect to hook data: how a next-token log-probability changes with a vector added to the residual
stream in the middle of the model (the direction a steering vector should take), by `jax.grad` through
`forward_dense` with hooks, checked against a finite difference (python docs/examples/hook_gradients.py [MODEL])."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from netra_jax import LLM, Hooks
from netra_jax.models.hooks import hook_name
from netra_jax.models.transformer import forward_dense

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg, params = llm.model_config, llm.params
ids = jnp.asarray(llm.get_tokenizer().encode("The capital of France is Paris"), jnp.int32)  # [T]
point = hook_name(cfg.num_layers // 2, "resid_post")


def add(x, ctx):  # x: [T, hidden]; ctx.data: the vector [hidden], a traced argument
    return x + ctx.data.astype(x.dtype)


def target_logprob(vector):  # log p(last token | the others) with `vector` added at `point`
    hooks = Hooks(edit={point: add}, data={point: vector})
    logits, _ = forward_dense(params, cfg, ids[:-1], hooks=hooks)  # [T - 1, vocab] (and what the hooks record)
    return jax.nn.log_softmax(logits[-1])[ids[-1]]


grad = jax.jit(jax.grad(target_logprob))(jnp.zeros(cfg.hidden_size, jnp.float32))  # [hidden]
print(f"|d log p / d vector| at {point}: {float(jnp.linalg.norm(grad)):.4f}")

# checked: a central finite difference along the gradient's own direction
u = grad / jnp.linalg.norm(grad)
eps = 1e-2
fd = (target_logprob(eps * u) - target_logprob(-eps * u)) / (2 * eps)
print(f"directional derivative: grad {float(grad @ u):.5f}, finite difference {float(fd):.5f}")
assert np.isclose(float(grad @ u), float(fd), rtol=2e-2, atol=1e-4)
