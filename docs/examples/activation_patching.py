"""Activation patching between two prompts: record the residual stream of a clean prompt, write it into a corrupted
prompt's run at one position and layer, and measure how much of the clean prediction comes back
(python docs/examples/activation_patching.py [MODEL])."""

import sys

import jax.numpy as jnp
import numpy as np

from netra_jax import LLM, Hooks
from netra_jax.models.hooks import hook_name

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg, tok = llm.model_config, llm.get_tokenizer()
clean = tok.encode("When Mary and John went to the store, John gave a drink to")
corrupt = list(clean)
corrupt[-5] = clean[1]  # the second " John" becomes " Mary" (positions as SmolLM2's tokenizer splits the text)
T = len(clean)


def patch(x, ctx):  # x: [tokens, hidden]; ctx.data: the clean stream [hidden] and the position to patch
    at = (ctx.positions == ctx.data["position"]) & ctx.valid  # [tokens]
    return jnp.where(at[:, None], ctx.data["resid"].astype(x.dtype), x)


def logprobs(logits):  # [vocab] -> log-softmax
    return logits - np.logaddexp.reduce(logits)


names = [hook_name(i, "resid_pre") for i in range(cfg.num_layers)]
clean_run = llm.run_with_hooks(clean, Hooks(record=names))
target = int(clean_run.logits[-1].argmax())  # the clean prompt's prediction
corrupt_lp = logprobs(llm.logits(corrupt)[-1])[target]
clean_lp = logprobs(clean_run.logits[-1])[target]
for layer in range(0, cfg.num_layers, max(1, cfg.num_layers // 6)):  # every few layers: a forward per cell
    name = names[layer]
    row = []
    for position in range(T):
        data = {"resid": clean_run.activations[name][position], "position": np.int32(position)}
        patched = llm.run_with_hooks(corrupt, Hooks(edit={name: patch}, data={name: data})).logits[-1]
        row.append((logprobs(patched)[target] - corrupt_lp) / (clean_lp - corrupt_lp + 1e-9))
    print(f"layer {layer:2d}: " + " ".join(f"{r:+.2f}" for r in row))


# patching every position of the first layer's input restores the clean run exactly
def patch_all(x, ctx):  # ctx.data: the clean stream [T, hidden], indexed by each row's position
    pos = jnp.clip(ctx.positions, 0, ctx.data.shape[0] - 1)  # [rows] (the forward may pad the prompt's rows)
    return jnp.where(ctx.valid[:, None], ctx.data[pos].astype(x.dtype), x)


stream = clean_run.activations[names[0]]  # [T, hidden]
restored = llm.run_with_hooks(corrupt, Hooks(edit={names[0]: patch_all}, data={names[0]: stream})).logits
assert np.allclose(restored, clean_run.logits, atol=1e-4)
