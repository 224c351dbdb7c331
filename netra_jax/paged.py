"""Public builders for calling `models.transformer.forward` over a paged KV cache outside the engine: the positions
and attention metadata of a ragged token batch from each sequence's lengths and block table, and the KV cache itself.

A batch holds S sequences' new tokens back to back ([T] flat). Sequence s has `seq_lens[s]` tokens of context after
this call (those already in its pages plus its `query_lens[s]` new ones, which come last) and owns the pages
`block_tables[s]` in order: its token at position p lives in page `block_tables[s][p // page_size]`, slot
`p % page_size`. Padding (to a fixed token or sequence count, so one compiled program serves batches of any size)
writes nothing: padding tokens get the padding slot, one past the last slot of the cache, which the KV write drops.

Example, on the tiny-llama test checkpoint (random weights): a prefill of two prompts padded to 16 tokens, then a
decode step of both over the same cache. Row i of a prefill's logits predicts the token after new token i; each
decode row the token after that sequence's new token::

    import jax.numpy as jnp

    from netra_jax import paged
    from netra_jax.loader import load_model
    from netra_jax.models.transformer import forward

    model_dir = "tiny-llama"  # a Hugging Face checkpoint directory
    cfg, params = load_model(model_dir, "float32")
    page_size, num_pages = 4, 8
    kv = paged.init_kv_cache(cfg, num_pages, page_size, jnp.float32)
    prompts = [[54, 273, 223, 467, 334, 77, 298], [277, 72, 315, 67, 264]]
    tables = [[5, 2], [0, 7]]  # the pages of each sequence: 2 x 4 slots hold 8 tokens

    # prefill: every prompt token is new
    batch = paged.build_batch(
        [7, 5], [7, 5], tables, page_size=page_size, num_pages=num_pages, num_tokens=16
    )
    tokens = paged.flat_tokens(prompts, num_tokens=16)  # [16] int32
    prefill_logits, kv = forward(params, cfg, tokens, batch.positions, kv, batch.metadata)  # [16, vocab]
    first = prefill_logits[:7]  # the first prompt's rows; the second's are rows 7 to 11, 12 to 15 are padding

    # decode: one new token each (the next prompt token here), attending to its cached prompt
    batch = paged.build_batch([8, 6], [1, 1], tables, page_size=page_size, num_pages=num_pages)
    tokens = paged.flat_tokens([[318], [10]])
    decode_logits, kv = forward(params, cfg, tokens, batch.positions, kv, batch.metadata)  # [2, vocab]

`forward(..., logits_indices=batch.last_token_indices)` returns only each sequence's last row ([S, vocab]).
"""

from __future__ import annotations

from netra_jax.models.transformer import KVCache, init_kv_cache
from netra_jax.ops.attention import AttentionMetadata
from netra_jax.ops.attention.paged_batch import PagedBatch, build_batch, flat_tokens, padding_slot, token_slots

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "PagedBatch",
    "build_batch",
    "flat_tokens",
    "init_kv_cache",
    "padding_slot",
    "token_slots",
]
