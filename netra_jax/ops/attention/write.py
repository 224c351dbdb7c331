"""The KV write: a step's new keys and values scattered into their slots of the paged cache, in place in the
donated pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Scatter new keys/values into their slots, in place in the (donated) pages. Padding tokens carry an
    out-of-range slot and are dropped.

    A lone token's write gets a second, dropped entry: XLA turns a one-index scatter into a dynamic-update-slice
    that reads the old value at the slot, and then copies the whole page array rather than update it in place
    (on CPU a decode step of a 1 GiB cache copied every layer's pages: 0.9 s a token instead of 0.04).

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]; slot_mapping: [T].
    """
    n, p, h, d = k_pages.shape
    if slot_mapping.shape[0] == 1:  # a lone token: add a dropped one (see the docstring)
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), n * p, slot_mapping.dtype)])
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    kf = k_pages.reshape(n * p, h, d).at[slot_mapping].set(k.astype(k_pages.dtype), mode="drop")
    vf = v_pages.reshape(n * p, h, d).at[slot_mapping].set(v.astype(v_pages.dtype), mode="drop")
    return kf.reshape(n, p, h, d), vf.reshape(n, p, h, d)
