"""Training a LoRA adapter with jax.grad and optax, then serving it: a few Adam steps on the cross entropy of a chosen
continuation, through `forward_dense` with the adapter as its one slot (`adapter_slots`, differentiable in the
factors); then `generate` with the trained adapter in memory, and again from the PEFT directory it is saved to
(python docs/examples/lora_training.py [MODEL])."""

import dataclasses
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax

from netra_jax import LLM, LoRARequest, SamplingParams
from netra_jax.models.lora import adapter_slots, init_adapter, save_peft_adapter
from netra_jax.models.transformer import forward_dense

RANK, STEPS = 8, 20
model = sys.argv[1] if len(sys.argv) > 1 else None  # None: the default model
llm = LLM(model, enable_lora=True, max_lora_rank=RANK)
cfg, params, tok = llm.model_config, llm.params, llm.get_tokenizer()

# the task: continue this prompt with this sentence
prompt, target = "My favourite animal is", " a green dragon."
prompt_ids, target_ids = tok.encode(prompt), tok.encode(target, add_special_tokens=False)
ids = jnp.asarray(prompt_ids + target_ids, jnp.int32)  # [T]
n = len(prompt_ids)


def loss(weights, params):  # mean next-token cross entropy of the target's tokens, given the prompt
    slots = adapter_slots(cfg, weights, RANK)  # per layer {group: (a [in, 1, Rg], b [1, Rg, out])}, built with jnp
    logits = forward_dense(params, cfg, ids[:-1], lora=slots, lora_slot=0)  # [T-1, vocab]
    logp = jax.nn.log_softmax(logits[n - 1 :])  # the positions that predict the target
    return -jnp.take_along_axis(logp, ids[n:, None], 1).mean()


# PEFT's initialisation on every target (q, k, v, o, gate, up, down): A random, B zeros, so it starts as the base model
adapter = init_adapter(cfg, jax.random.key(0), RANK)
opt = optax.adam(1e-2)


@jax.jit
def step(weights, opt_state, params):
    value, grads = jax.value_and_grad(loss)(weights, params)  # grads[(layer, target)] = (d a [in, r], d b [r, out])
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(weights, updates), opt_state, value


weights, opt_state = adapter.weights, opt.init(adapter.weights)
losses = []
for _ in range(STEPS):
    weights, opt_state, value = step(weights, opt_state, params)
    losses.append(float(value))
print("loss every 5 Adam steps:", " ".join(f"{v:.3f}" for v in losses[::5] + losses[-1:]))
assert losses[-1] < 0.5 * losses[0]
trained = dataclasses.replace(adapter, name="trained", weights=weights)  # a LoRAAdapter of jax arrays

# serve it in the same process: an in-memory adapter, next to the base model
greedy = SamplingParams(temperature=0.0, max_tokens=len(target_ids))
base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
tuned = llm.generate(prompt, greedy, use_tqdm=False, lora_request=LoRARequest("trained", 1, adapter=trained))
tuned = tuned[0].outputs[0]
print(f"base:    {prompt!r} -> {base.text!r}")
print(f"adapted: {prompt!r} -> {tuned.text!r}")
assert list(tuned.token_ids) == target_ids  # the engine's greedy decoding now gives the target

# saved as a PEFT directory (adapter_config.json + adapter_model.safetensors) and served from it: the same output
with tempfile.TemporaryDirectory() as d:
    save_peft_adapter(trained, d, base_model_name_or_path=model)
    from_dir = llm.generate(prompt, greedy, use_tqdm=False, lora_request=LoRARequest("trained-peft", 2, lora_path=d))
print(f"from the PEFT directory: {from_dir[0].outputs[0].text!r}")
assert from_dir[0].outputs[0].token_ids == tuned.token_ids
