"""Head ablation two ways: a head mask at a hook point, and the same head cut out of the weights with
`update_params`; both give the same logits (python docs/examples/head_ablation.py [MODEL])."""

import sys

import numpy as np

from netra_jax import LLM, Hooks

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg = llm.model_config
layer, head = cfg.num_layers - 1, 0
prompt = "The quick brown fox jumps over the lazy dog. The quick brown"

mask = np.ones(cfg.num_heads, np.float32)  # [q_heads] multipliers of each head's attention output
mask[head] = 0.0
masked = llm.run_with_hooks(prompt, Hooks(head_mask={layer: mask})).logits  # [T, vocab]

# the same ablation in the weights: the head's rows of the output projection wo [q_heads * head_dim, hidden]
params = llm.params.unfreeze()  # plain dicts and lists over the live arrays (llm.params itself is read-only)
wo = np.array(params["layers"][layer]["wo"])
wo[head * cfg.head_dim : (head + 1) * cfg.head_dim] = 0.0
params["layers"][layer] = {**params["layers"][layer], "wo": wo}
with llm.update_params(params):  # the prefix cache is dropped; the old weights come back on exit
    cut = llm.logits(llm.get_tokenizer().encode(prompt))

print(
    "largest change the ablation makes:", float(np.abs(masked - llm.logits(llm.get_tokenizer().encode(prompt))).max())
)
assert np.allclose(masked, cut, atol=1e-4)
