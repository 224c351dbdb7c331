"""The one attention entry point over the paged KV cache, and the KV write. A flat ragged token batch (many
sequences' new tokens concatenated) attends to each sequence's pages through its block table; plain jnp here."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from netra_jax.ops.paged_attention_triton import paged_attention_triton, paged_attention_triton_interpret

# The reference gathers keys in chunks of _KEY_CHUNK positions per query token, for at most _REF_GATHER_ELEMS
# gathered elements (tokens x chunk x kv_heads x head_dim) at once; larger batches loop over token blocks.
# 64-key chunks measured fastest on CPU (gathered chunks stay in cache; fewer masked keys than 128).
_KEY_CHUNK = 64
_REF_GATHER_ELEMS = 1 << 24
_NEG = -1e30


@flax.struct.dataclass
class TokenLayout:
    """Per-token view of a step's ragged batch, derived once per step and shared by every layer."""

    seq_idx: jax.Array  # [T] int32 sequence of each token (clamped into range for padding tokens)
    q_pos: jax.Array  # [T] int32 absolute position of each token (0 for padding)
    valid: jax.Array  # [T] bool real (non-padding) token
    rows: jax.Array  # [T, max_pages] int32 block-table row of each token's sequence


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch. T = padded token count, S = padded sequence count."""

    slot_mapping: jax.Array  # [T] int32 flat KV slot (page * page_size + offset) for each new token; padding >= slots
    query_start_loc: jax.Array  # [S + 1] int32 cumulative query lengths; padding sequences have length 0
    seq_lens: jax.Array  # [S] int32 context length of each sequence after this step (cached + new); 0 for padding
    block_tables: jax.Array  # [S, max_pages] int32 page ids of each sequence; unused entries 0
    layout: TokenLayout | None = None  # filled by `with_token_layout`; the reference derives it when absent


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Scatter new keys/values into their slots. Padding tokens carry an out-of-range slot and are dropped.

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]; slot_mapping: [T].
    """
    n, p, h, d = k_pages.shape
    kf = k_pages.reshape(n * p, h, d).at[slot_mapping].set(k.astype(k_pages.dtype), mode="drop")
    vf = v_pages.reshape(n * p, h, d).at[slot_mapping].set(v.astype(v_pages.dtype), mode="drop")
    return kf.reshape(n, p, h, d), vf.reshape(n, p, h, d)


def token_layout(md: AttentionMetadata, num_tokens: int):
    """Derive each token's sequence index and absolute position from the metadata.

    Returns (seq_idx [T] int32, q_pos [T] int32, valid [T] bool)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = md.query_start_loc
    seq_idx = jnp.searchsorted(qsl[1:], t, side="right").astype(jnp.int32)
    valid = t < qsl[-1]
    seq_idx = jnp.minimum(seq_idx, md.seq_lens.shape[0] - 1)
    q_len = qsl[seq_idx + 1] - qsl[seq_idx]
    q_pos = md.seq_lens[seq_idx] - q_len + (t - qsl[seq_idx])
    return seq_idx, jnp.where(valid, q_pos, 0), valid


def with_token_layout(md: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """md with its per-token layout computed (once per step, instead of once per layer)."""
    if md.layout is not None:
        return md
    seq_idx, q_pos, valid = token_layout(md, num_tokens)
    return md.replace(layout=TokenLayout(seq_idx, q_pos, valid, md.block_tables[seq_idx]))


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Plain-jnp ragged paged attention with an online softmax over fixed-size key chunks.

    Each query token gathers its own sequence's pages, `_KEY_CHUNK` keys at a time, for as many chunks as the
    longest context of the step needs (a dynamic trip count, so cost follows the real lengths and no context-length
    bucket is compiled). Chunk boundaries are absolute positions, so a token's arithmetic does not depend on its
    batch companions: extra chunks of a longer companion are fully masked for it and leave its sums unchanged.
    Scores and the weighted sum are elementwise products reduced in place: on CPU XLA fuses them into the loop
    over the gathered chunk, which is faster than batched (token, head) matmuls of this small size.

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] (already holding this
    step's keys). Returns [T, q_heads, head_dim] in q's dtype; padding tokens give zeros. Math in float32.
    """
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    ppc = max(1, _KEY_CHUNK // P)  # pages per chunk
    ck = ppc * P  # keys per chunk
    lay = with_token_layout(md, T).layout
    rows = lay.rows  # [T, max_pages]
    pad = (-rows.shape[1]) % ppc
    if pad:
        rows = jnp.pad(rows, ((0, 0), (0, pad)))
    n_chunks = (jnp.max(md.seq_lens) + ck - 1) // ck
    first = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.min(jnp.where(lay.valid, lay.q_pos, jnp.iinfo(jnp.int32).max)) - sliding_window + 1
        first = jnp.clip(lo // ck, 0, None).astype(jnp.int32)

    def token_block(args):
        qb, rb, pb, vb = args  # [Tb, H, D], [Tb, pages], [Tb], [Tb]
        tb = qb.shape[0]
        qg = qb.astype(jnp.float32).reshape(tb, 1, KH, G, D) * scale  # [Tb, 1, KH, G, D]

        def body(c, carry):
            m, l, acc = carry  # [Tb, KH, G], [Tb, KH, G], [Tb, KH, G, D]
            pages = jax.lax.dynamic_slice_in_dim(rb, c * ppc, ppc, axis=1)  # [Tb, ppc]
            # clip mode: page ids are in range by construction, and it gathers far faster than checked indexing
            k = jnp.take(k_pages, pages, axis=0, mode="clip").reshape(tb, ck, KH, 1, D).astype(jnp.float32)
            v = jnp.take(v_pages, pages, axis=0, mode="clip").reshape(tb, ck, KH, 1, D).astype(jnp.float32)
            s = (qg * k).sum(-1)  # [Tb, ck, KH, G]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kpos = c * ck + jnp.arange(ck, dtype=jnp.int32)[None, :]  # [1, ck]
            mask = kpos <= pb[:, None]
            if sliding_window is not None:
                mask &= kpos > pb[:, None] - sliding_window
            mask = mask[:, :, None, None]  # [Tb, ck, 1, 1]
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, s.max(1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [Tb, ck, KH, G]
            acc = acc * alpha[..., None] + (p[..., None] * v).sum(1)
            return m_new, l * alpha + p.sum(1), acc

        init = (
            jnp.full((tb, KH, G), _NEG, jnp.float32),
            jnp.zeros((tb, KH, G), jnp.float32),
            jnp.zeros((tb, KH, G, D), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return jnp.where(vb[:, None, None], o.reshape(tb, H, D), 0.0).astype(q.dtype)

    tb = max(1, min(T, _REF_GATHER_ELEMS // (ck * KH * D)))
    if tb >= T:
        return token_block((q, rows, lay.q_pos, lay.valid))
    nb = -(-T // tb)
    padn = nb * tb - T
    blocks = [
        jnp.pad(a, [(0, padn)] + [(0, 0)] * (a.ndim - 1)).reshape((nb, tb) + a.shape[1:])
        for a in (q, rows, lay.q_pos, lay.valid)
    ]
    return jax.lax.map(token_block, tuple(blocks)).reshape(nb * tb, H, D)[:T]


def _auto(q, k_pages, v_pages, md, **kw):
    """The Pallas kernel on GPU, the jnp reference elsewhere."""
    fn = paged_attention_triton if jax.default_backend() == "gpu" else paged_attention_reference
    return fn(q, k_pages, v_pages, md, **kw)


BACKENDS = {
    "reference": paged_attention_reference,
    "triton": paged_attention_triton,
    "triton_interpret": paged_attention_triton_interpret,
    "auto": _auto,
}


def attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "reference",
) -> jax.Array:
    """Ragged paged attention through the selected backend (see `BACKENDS`). Shapes as in the reference."""
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}") from None
    return fn(q, k_pages, v_pages, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
