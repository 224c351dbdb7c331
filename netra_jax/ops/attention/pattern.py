"""Attention probabilities made explicit, for the `pattern` hook point: each query row's post-softmax weights over
its sequence's keys in position order, and attention recomputed from (edited) weights.

Memory: the keys of `num_keys` positions of each token's block table are gathered in float32, [T, num_keys, kv_heads,
head_dim] (once, without the T, for a batch of one sequence), and the probabilities are [T, q_heads, num_keys]
float32: a hooked layer's pattern costs T x heads x keys, so it is opt-in per layer and the engine bounds num_keys
by the longest hooked sequence of the step (see `netra_jax.models.hooks`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from netra_jax.ops.attention.metadata import AttentionMetadata, with_token_layout
from netra_jax.ops.attention.reference import masked_scores
from netra_jax.ops.kv_quant import Pages, take_pages


def _key_rows(md: AttentionMetadata, T: int, page_size: int, num_keys: int | None):
    """(block-table rows [(T,) pages], einsum key spec, key count K): the pages holding the first num_keys keys of
    each token's sequence (all of the block table when None; K at most the table's width in keys)."""
    lay = with_token_layout(md, T).layout
    width = lay.rows.shape[1]
    pages = width if num_keys is None else min(width, -(-num_keys // page_size))
    one = md.block_tables.shape[0] == 1  # one sequence: every token's keys are the same, gathered once
    rows = md.block_tables[0, :pages] if one else lay.rows[:, :pages]
    K = pages * page_size if num_keys is None else min(num_keys, pages * page_size)
    return rows, ("ckd" if one else "tckd"), K


def _gather(pages: Pages, rows: jax.Array, K: int) -> jax.Array:
    _, P, KH, D = pages.shape
    keys = take_pages(pages, rows).reshape(*rows.shape[:-1], rows.shape[-1] * P, KH, D)
    return keys[..., :K, :, :]  # [(T,) K, KH, D] float32


def attention_probs(
    q: jax.Array,
    k_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    num_keys: int | None = None,
) -> jax.Array:
    """Post-softmax attention probabilities of each query row: q [T, q_heads, head_dim] (after RoPE) against the keys
    already written to k_pages -> [T, q_heads, K] float32, K = num_keys (at most the block table's width in keys;
    None: that width). Key j is position j of the row's sequence; masked keys (causal, sliding window) are 0; with
    attention sinks each sink's logit joins the denominator but is not a column (rows then sum to less than 1).
    Padding rows are all zero; a key past K is left out of the denominator, so give K >= the longest sequence."""
    T, H, D = q.shape
    KH = k_pages.shape[2]
    G = H // KH
    rows, keys, K = _key_rows(md, T, k_pages.shape[1], num_keys)
    lay = with_token_layout(md, T).layout
    qg = q.astype(jnp.float32).reshape(T, KH, G, D) * scale
    s = jnp.einsum(f"tkgd,{keys}->tkgc", qg, _gather(k_pages, rows, K), precision=jax.lax.Precision.HIGHEST)
    qpos = jnp.where(lay.valid, lay.q_pos, -1)[:, None, None, None]  # padding rows see no key
    s, mask = masked_scores(s, jnp.arange(K, dtype=jnp.int32), qpos, sliding_window, soft_cap)  # [T, KH, G, K]
    m = s.max(-1)  # [T, KH, G]
    if sinks is not None:
        sk = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(KH, G), m.shape)
        m = jnp.maximum(m, sk)
    m = jax.lax.stop_gradient(m)  # the softmax does not depend on it
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    den = p.sum(-1) if sinks is None else p.sum(-1) + jnp.exp(sk - m)
    p = p / jnp.where(den > 0, den, 1.0)[..., None]
    return p.reshape(T, H, K)


def attend_probs(probs: jax.Array, v_pages: Pages, md: AttentionMetadata) -> jax.Array:
    """Attention output from given probabilities: probs [T, q_heads, K] (as `attention_probs` lays them out) times
    each row's values -> [T, q_heads, head_dim] float32."""
    T, H, K = probs.shape
    KH = v_pages.shape[2]
    rows, keys, _ = _key_rows(md, T, v_pages.shape[1], K)
    pg = probs.astype(jnp.float32).reshape(T, KH, H // KH, K)
    o = jnp.einsum(f"tkgc,{keys}->tkgd", pg, _gather(v_pages, rows, K), precision=jax.lax.Precision.HIGHEST)
    return o.reshape(T, H, -1)
