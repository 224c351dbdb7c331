"""The pure forward over a paged KV cache of your own, built with `netra_jax.paged`: a prefill of two prompts in one
ragged batch, then a decode step of both over the same cache; checked against the dense forward
(python docs/examples/paged_forward.py [MODEL])."""

import sys

import jax.numpy as jnp
import numpy as np

from netra_jax import LLM, paged
from netra_jax.models.transformer import forward, forward_dense

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)  # or: cfg, params = netra_jax.loader.load_model(path)
cfg, params, tok = llm.model_config, llm.params, llm.get_tokenizer()
prompts = [tok.encode("The sky is"), tok.encode("One, two, three,")]
page_size, num_pages = 4, 16
kv = paged.init_kv_cache(cfg, num_pages, page_size, jnp.float32)
tables = [[3, 1, 4, 0], [2, 7, 5, 6]]  # each sequence's pages, in order (room for 16 tokens each)
lens = [len(p) for p in prompts]

# prefill: every prompt token is new; padded to 32 tokens so other prompt lengths reuse the compiled program
batch = paged.build_batch(lens, lens, tables, page_size=page_size, num_pages=num_pages, num_tokens=32)
tokens = paged.flat_tokens(prompts, num_tokens=32)  # [32] int32
logits, kv = forward(params, cfg, tokens, batch.positions, kv, batch.metadata, batch.last_token_indices)  # [2, vocab]
next_ids = np.asarray(logits).argmax(-1)  # each prompt's greedy next token

# decode: one new token per sequence, attending to its cached prompt
batch = paged.build_batch([n + 1 for n in lens], [1, 1], tables, page_size=page_size, num_pages=num_pages)
logits, kv = forward(params, cfg, paged.flat_tokens([[int(t)] for t in next_ids]), batch.positions, kv, batch.metadata)
for p, t, row in zip(prompts, next_ids, np.asarray(logits), strict=True):
    print(repr(tok.decode(p + [int(t), int(row.argmax())])))
    # the same position computed densely, without a cache: the same logits
    dense = np.asarray(forward_dense(params, cfg, jnp.asarray(p + [int(t)], jnp.int32)))[-1]
    assert np.allclose(row, dense, atol=1e-4)
