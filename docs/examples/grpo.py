"""GRPO with the engine as the sampler: each step the engine samples a group of completions per prompt (temperature,
n samples), a rule scores them, the advantages are the rewards normalised within each group, and optax follows the
policy gradient of the clipped surrogate through `netra_jax.rl.sequence_logprobs`; `update_params` hands the new
weights to the engine (no copy), which sleeps through the update. The engine runs batch-invariant, so the trainer's
log-probabilities of the sampled tokens are the sampler's bit for bit: the importance ratio of the first update is
exactly 1 (python docs/examples/grpo.py [MODEL])."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from netra_jax import LLM, SamplingParams
from netra_jax.rl import sequence_logprobs

STEPS, GROUP, NEW_TOKENS, EPOCHS, CLIP = 5, 8, 8, 2, 0.2
model = sys.argv[1] if len(sys.argv) > 1 else None  # None: the default model
llm = LLM(model, dtype="float32", batch_invariant=True, max_num_seqs=32)
cfg, tok = llm.model_config, llm.get_tokenizer()
prompts = [tok.encode(t) for t in ("The weather today is", "Once upon a time", "My favourite number is", "Hello")]


def reward(token_ids) -> float:  # the rule: the share of even token ids in the completion
    return float(np.mean([t % 2 == 0 for t in token_ids]))


def loss(params, outputs, old, advantages, sp):
    """GRPO's clipped surrogate, per token, against the sampler's (processed) logprobs `old` [B, N]."""
    lps = sequence_logprobs(params, cfg, [p for p in prompts for _ in range(GROUP)], outputs, sp)
    new = jnp.stack([lp.processed for lp in lps])  # [B, N]: what each token was drawn with, under params
    ratio = jnp.exp(new - old)
    a = advantages[:, None]  # [B, 1]
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * a)
    return -surrogate.mean(), lps


params = llm.params  # the trainer starts from the engine's weights (a read-only view; optax returns new trees)
opt = optax.adam(1e-2)  # a large step: the reward moves within a few steps
opt_state = opt.init(params)
grad_fn = jax.value_and_grad(loss, has_aux=True)
rewards, gaps = [], []
for step in range(STEPS):
    sp = SamplingParams(n=GROUP, temperature=1.0, max_tokens=NEW_TOKENS, seed=step, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    samples = [c for o in outs for c in o.outputs]  # prompt-major, GROUP each
    outputs = [c.token_ids for c in samples]
    old = jnp.asarray([c.processed_logprobs for c in samples], jnp.float32)  # [B, N] the sampler's, float32 exactly
    old_raw = np.asarray([c.raw_logprobs for c in samples], np.float32)
    r = np.asarray([reward(t) for t in outputs]).reshape(len(prompts), GROUP)
    advantages = jnp.asarray(((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1))
    llm.sleep(level=1)  # the KV cache's memory is the trainer's until the new weights are in
    for epoch in range(EPOCHS):
        (value, lps), grads = grad_fn(params, outputs, old, advantages, sp)
        if epoch == 0:  # the trainer's logprobs at the weights that sampled: the sampler's, bit for bit
            gaps.append(
                max(
                    float(np.abs(np.stack([lp.processed for lp in lps]) - np.asarray(old)).max()),
                    float(np.abs(np.stack([lp.raw for lp in lps]) - old_raw).max()),
                )
            )
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    llm.update_params(params)  # the engine now samples with the trained weights (its arrays referenced, not copied)
    llm.wake_up()
    rewards.append(float(r.mean()))
    print(f"step {step}: mean reward {rewards[-1]:.3f}, surrogate loss {float(value):+.4f}")

# the same gap for transformers: its generate's logprobs against its own forward on the same tokens (measured once by
# tests/fixtures/make_hf_logprob_gap.py on the tiny fixtures; the default model's file is not one of them)
hf = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf_logprob_gap.json"
name = Path(model).name if model and Path(model).name.startswith("tiny-") else "tiny-llama"
hf_gap = json.loads(hf.read_text())["models"].get(name, {}).get("float32") if hf.is_file() else None
theirs = f"{max(hf_gap['raw'], hf_gap['processed']):.2e} ({name}, float32)" if hf_gap else "not measured"
print(f"max |sampler logprob - trainer logprob|: netra_jax {max(gaps)}, transformers {theirs}")
assert max(gaps) == 0.0
assert rewards[-1] > rewards[0]  # the policy learnt the rule
