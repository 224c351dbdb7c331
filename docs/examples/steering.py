"""A steering vector added to the residual stream after layer k, inside the serving engine's jitted steps: the
vector is hook data, so trying other scales reuses the compiled step (python docs/examples/steering.py [MODEL])."""

import sys

import numpy as np

from netra_jax import LLM, Hooks, SamplingParams
from netra_jax.models.hooks import hook_name

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg = llm.model_config
k = cfg.num_layers // 2
point = hook_name(k, "resid_post")
greedy = SamplingParams(temperature=0.0, max_tokens=12)


# a direction: the difference of two prompts' mean residual streams at layer k
def mean_resid(text):
    return llm.run_with_hooks(text, Hooks(record=[point])).activations[point].mean(0)  # [hidden]


direction = mean_resid("I love this, it is wonderful and great.") - mean_resid("I hate this, it is awful and bad.")


def steer(x, ctx):  # x: [tokens, hidden]; ctx.data: the vector
    return x + ctx.data.astype(x.dtype)


prompt = "My opinion of the movie:"
plain = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
for scale in (4.0, 8.0):
    hooks = Hooks(edit={point: steer}, data={point: scale * direction})
    out = llm.generate([prompt], greedy, hooks=hooks, use_tqdm=False)[0].outputs[0]
    print(f"scale {scale}: {out.text!r}")
print(f"unsteered: {plain.text!r}")

# checked: the edit reached the residual stream exactly
rec = llm.run_with_hooks(prompt, Hooks(edit={point: steer}, data={point: direction}, record=[point]))
base = llm.run_with_hooks(prompt, Hooks(record=[point]))
assert np.allclose(rec.activations[point], base.activations[point] + direction, atol=1e-4)
