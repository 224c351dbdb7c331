"""Activation patching over layers x positions (the indirect-object sweep): record a clean prompt's residual
stream, write it into a corrupted prompt's run at one layer and position per run, all runs batched in one engine
call, and see where the answer is carried; checked against one call per patch
(python docs/examples/activation_patching.py [MODEL])."""

import sys
import time

import numpy as np

from netra_jax import LLM, Hooks, patch, patching_sweep
from netra_jax.models.hooks import hook_name

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg, tok = llm.model_config, llm.get_tokenizer()
clean = tok.encode("When Mary and John went to the store, John gave a drink to")
corrupt = list(clean)
corrupt[-5] = clean[1]  # the second " John" becomes " Mary" (positions as SmolLM2's tokenizer splits the text)
io, s = clean[1], clean[3]  # " Mary" (the answer of the clean prompt) and " John"


def logit_diff(logits):  # [vocab] -> how much the model prefers " Mary" over " John"
    return float(logits[io] - logits[s])


points = [hook_name(i, "resid_pre") for i in range(cfg.num_layers)]
sweep = patching_sweep(llm, clean, corrupt, points)  # one engine call for every (layer, position)
effect = sweep.normalized(logit_diff)  # [layers, positions]: 0 = the corrupted run, 1 = the clean run
print(f"logit diff clean {logit_diff(sweep.clean_logits):+.2f}, corrupted {logit_diff(sweep.corrupted_logits):+.2f}")
words = [tok.decode([t]) for t in corrupt]
print("layer " + " ".join(f"{w.strip()[:5]:>5}" for w in words))
for layer in range(cfg.num_layers):
    print(f"{layer:5d} " + " ".join(f"{e:+5.2f}" for e in effect[layer]))

# the same sweep as one forward per patch: equal values, and the time of both
t0 = time.perf_counter()
source = llm.run_with_cache([clean], names=points)[0]
loop = np.zeros_like(sweep.logits)
for i, name in enumerate(points):
    for p in range(len(clean)):
        data = {name: {"values": source[name], "mask": np.arange(len(clean)) == p}}
        loop[i, p] = llm.run_with_hooks(corrupt, Hooks(edit={name: patch}, data=data)).logits[-1]
loop_s = time.perf_counter() - t0
print(f"{len(points) * len(clean)} patched runs: batched {sweep.seconds:.2f} s, one call each {loop_s:.2f} s")
assert np.allclose(sweep.logits, loop, atol=1e-3), np.abs(sweep.logits - loop).max()
# patching every position of the first layer's input restores the clean run exactly
every = Hooks(
    edit={points[0]: patch}, data={points[0]: {"values": source[points[0]], "mask": np.ones(len(clean), bool)}}
)
assert np.allclose(llm.run_with_hooks(corrupt, every).logits[-1], sweep.clean_logits, atol=1e-3)
