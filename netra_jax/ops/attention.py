"""The one attention entry point over the paged KV cache, and the KV write. A flat ragged token batch (many
sequences' new tokens concatenated) attends to each sequence's pages through its block table; plain jnp here."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from netra_jax.ops.paged_attention_triton import paged_attention_triton, paged_attention_triton_interpret

# Maximum elements of the per-token gathered K (tokens x context x kv_heads x head_dim) materialised at once by the
# reference; longer batches are processed in chunks of query tokens.
_REF_GATHER_ELEMS = 1 << 26


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch. T = padded token count, S = padded sequence count."""

    slot_mapping: jax.Array  # [T] int32 flat KV slot (page * page_size + offset) for each new token; padding >= slots
    query_start_loc: jax.Array  # [S + 1] int32 cumulative query lengths; padding sequences have length 0
    seq_lens: jax.Array  # [S] int32 context length of each sequence after this step (cached + new); 0 for padding
    block_tables: jax.Array  # [S, max_pages] int32 page ids of each sequence; unused entries 0


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
    """Plain-jnp ragged paged attention: each query token gathers its sequence's pages and attends causally.

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] (already holding this
    step's keys). Returns [T, q_heads, head_dim] in q's dtype; padding tokens give zeros. Math in float32.
    """
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    seq_idx, q_pos, valid = token_layout(md, T)
    max_pages = md.block_tables.shape[1]
    C = max_pages * P  # static context bound of this step

    def chunk(args):
        qc, sc, pc, vc = args  # [Tc, H, D], [Tc], [Tc], [Tc]
        pages = md.block_tables[sc]  # [Tc, max_pages]
        kc = k_pages[pages].reshape(-1, C, KH, D).astype(jnp.float32)  # [Tc, C, KH, D]
        vv = v_pages[pages].reshape(-1, C, KH, D).astype(jnp.float32)  # [Tc, C, KH, D]
        qg = qc.astype(jnp.float32).reshape(-1, KH, G, D)  # [Tc, KH, G, D]
        s = jnp.einsum("tkgd,tckd->tkgc", qg, kc) * scale  # [Tc, KH, G, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = jnp.arange(C, dtype=jnp.int32)[None, :]  # [1, C]
        mask = kpos <= pc[:, None]  # causal at the absolute position
        if sliding_window is not None:
            mask &= kpos > pc[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("tkgc,tckd->tkgd", p, vv).reshape(-1, H, D)
        return jnp.where(vc[:, None, None], o, 0.0).astype(q.dtype)

    per_token = C * KH * D
    tc = max(1, min(T, _REF_GATHER_ELEMS // max(per_token, 1)))
    if tc >= T:
        return chunk((q, seq_idx, q_pos, valid))
    n_chunks = -(-T // tc)
    pad = n_chunks * tc - T
    padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, seq_idx, q_pos, valid)]
    stacked = [a.reshape((n_chunks, tc) + a.shape[1:]) for a in padded]
    out = jax.lax.map(chunk, tuple(stacked))
    return out.reshape(n_chunks * tc, H, D)[:T]


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
