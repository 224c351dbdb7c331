"""Logit lens: what the model would predict from the residual stream after each layer, read through the hook
points during ordinary generation (python docs/examples/logit_lens.py [MODEL])."""

import sys

import numpy as np

from netra_jax import LLM, Hooks, SamplingParams
from netra_jax.models.hooks import hook_name
from netra_jax.models.transformer import logit_lens

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
cfg, tok = llm.model_config, llm.get_tokenizer()
names = [hook_name(i, "resid_post") for i in range(cfg.num_layers)]
out = llm.generate(
    ["The capital of France is"],
    SamplingParams(temperature=0.0, max_tokens=4),
    hooks=Hooks(record=names),
    use_tqdm=False,
)[0]
prompt_len = len(out.prompt_token_ids)
for i, name in enumerate(names):
    resid = out.activations[name]  # [prompt + output - 1 positions, hidden], padding removed
    top = np.asarray(logit_lens(llm.params, cfg, resid)).argmax(-1)  # [positions]
    print(f"layer {i:2d}: {tok.decode(top[prompt_len - 1 :].tolist())!r}")

# the last layer's lens is the model's own prediction: the tokens it generated
lens = np.asarray(logit_lens(llm.params, cfg, out.activations[names[-1]]))
assert lens[prompt_len - 1 :].argmax(-1).tolist() == out.outputs[0].token_ids[: lens.shape[0] - prompt_len + 1]
