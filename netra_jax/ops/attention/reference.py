"""The plain-jnp reference of ragged paged attention: an online softmax over fixed-size key chunks, per token
(decode rows) or per query block (prefill rows) as the host's work lists say. Every kernel is tested against it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from netra_jax.ops.attention.metadata import AttentionMetadata, with_token_layout
from netra_jax.ops.attention.work import QUERY_BLOCK
from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.kv_quant import Pages, take_pages

# Two jnp paths, chosen per token by the host's work lists (see `build_work`):
# - per token (decode rows, speculative runs): _TOKEN_BLOCK tokens at once, each gathering its own sequence's keys
#   in chunks of _WHOLE_KEYS up to its last whole multiple of them, then of _TAIL_KEYS (see `_token_path`; on CPU the
#   long chunks cut a 6k-context decode's attention by a third against 64-key chunks, the short ones keep a short
#   context from computing many masked keys, and a block of tokens shares each loop step's fixed cost);
# - per query block (prefill rows): up to _QUERY_BLOCK consecutive tokens of one sequence share each gathered chunk
#   of _BLOCK_KEY_CHUNK keys and score it with one small matmul, _ITEM_GROUP blocks at once. Without it a prompt's
#   tokens would each gather the whole prompt again (quadratic KV traffic).
_WHOLE_KEYS = 512
_TAIL_KEYS = 128
_TOKEN_BLOCK = 16
_BLOCK_KEY_CHUNK = 128
_ITEM_GROUP = 16
_NEG = -1e30


def masked_scores(s, kpos, qpos, sliding_window, soft_cap):
    """Soft-cap then causal/window mask. s: [..., ck] scores broadcastable with kpos/qpos comparisons."""
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return jnp.where(mask, s, _NEG), mask


def _pad_pages(rows: jax.Array, ppc: int) -> jax.Array:
    """Block-table rows [n, pages] padded with page 0 to whole chunks of ppc pages (the extra keys are masked)."""
    pad = (-rows.shape[1]) % ppc
    return jnp.pad(rows, ((0, 0), (0, pad))) if pad else rows


def _first_chunk(min_pos, sliding_window, ck):
    if sliding_window is None:
        return jnp.int32(0)
    return jnp.clip((min_pos - sliding_window + 1) // ck, 0, None).astype(jnp.int32)


def _softmax_init(sinks, shape):
    """Online-softmax state (m, l) before any key: m = -inf-ish and l = 0, or, with attention sinks, the sink logit
    already counted (m = sink, l = exp(sink - sink) = 1), so the sink joins the denominator and adds no value.

    sinks: [KH, Q] float32 or None (Q = the query rows of one KV head); shape = (n, KH, Q)."""
    if sinks is None:
        return jnp.full(shape, _NEG), jnp.zeros(shape)
    return jnp.broadcast_to(sinks, shape), jnp.ones(shape)


def _decode_chunk(carry, qg, k_pages, v_pages, pages, kpos, qpos, *, sliding_window, soft_cap):
    """One online-softmax step of a block of tokens, each over its own chunk of keys: those of its `pages`, at
    absolute positions kpos, visible up to its position qpos. carry: (m, l, acc) [t, KH, G], [t, KH, G],
    [t, KH, G, D]; qg: [t, KH, G, D] scaled queries; pages: [t, ppc] page ids; kpos: [t, ck]; qpos: [t].
    A token whose qpos is below its chunk's keys gets an exact no-op (alpha = 1, p = 0)."""
    m, l, acc = carry
    t, KH, G, D = qg.shape
    ck = pages.shape[1] * k_pages.shape[1]

    def fetch(pages_array):  # [t, ck, KH, 1, D] float32, de-quantized if the cache is
        # clip mode: page ids are in range by construction, and it gathers far faster than checked indexing
        return take_pages(pages_array, pages).reshape(t, ck, KH, 1, D)

    # a multiply-and-sum (one fused loop over the gathered keys) rather than a batched dot: measured faster on CPU
    s = (fetch(k_pages) * qg[:, None]).sum(-1).transpose(0, 2, 3, 1)  # [t, KH, G, ck]
    s, mask = masked_scores(s, kpos[:, None, None, :], qpos[:, None, None, None], sliding_window, soft_cap)
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    pv = (p.transpose(0, 3, 1, 2)[..., None] * fetch(v_pages)).sum(1)  # [t, KH, G, D]
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv


def decode_chunks(page_size: int) -> tuple[int, int]:
    """Pages per chunk of the per-token path: (tail chunk, whole chunk), the whole chunk a multiple of the tail."""
    tail = max(1, _TAIL_KEYS // page_size)
    return tail, max(1, _WHOLE_KEYS // (tail * page_size)) * tail


def _token_path(out, q, k_pages, v_pages, lay, idx, count, *, scale, sliding_window, soft_cap, sinks):
    """Per-token attention for the tokens idx[:count] (others are T: dropped), written into out [T, H, D].
    sinks: [KH, G] float32 or None.

    Blocks of up to _TOKEN_BLOCK tokens at once. A token at position pos reads keys [0, n * W) in whole chunks of W
    keys, n = (pos + 1) // W, and the rest in tail chunks, each chunk on its own pages: a long context takes few
    large gathers, a short one computes at most one tail chunk past its end. The chunks a token goes through depend
    on its own position only (the block's loops run to its longest token; the extra steps are exact no-ops for the
    others), so a token takes the same keys in the same chunks whether decoded alone, beside other sequences or
    inside a speculative run (its float rounding may still differ with the block's size, as a matmul's does with
    its rows)."""
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    ppt, ppw = decode_chunks(P)  # pages per tail chunk, per whole chunk
    ckt, ckw = ppt * P, ppw * P
    rows_all = _pad_pages(lay.rows, ppw)
    last_page = rows_all.shape[1] - 1
    step = functools.partial(
        _decode_chunk, k_pages=k_pages, v_pages=v_pages, sliding_window=sliding_window, soft_cap=soft_cap
    )
    tb = min(_TOKEN_BLOCK, idx.shape[0])
    if idx.shape[0] % tb:
        idx = jnp.pad(idx, (0, tb - idx.shape[0] % tb), constant_values=T)

    def block(b, out):
        ti = jax.lax.dynamic_slice_in_dim(idx, b * tb, tb)  # [tb] token ids (T = none)
        tc = jnp.minimum(ti, T - 1)
        pos = jnp.where((ti < T) & lay.valid[tc], lay.q_pos[tc], -1)  # [tb]; -1: no keys
        rows = rows_all[tc]  # [tb, pages]
        qg = q[tc].astype(jnp.float32).reshape(tb, KH, G, D) * scale
        n_whole = (pos + 1) // ckw  # [tb]
        n_tail = (pos + 1 - n_whole * ckw + ckt - 1) // ckt
        # chunks wholly before a sliding window change nothing: a token starts at the first that can
        lo_whole = _first_chunk(pos, sliding_window, ckw)  # [tb] (or 0)
        lo_tail = _first_chunk(pos - n_whole * ckw, sliding_window, ckt)

        def whole(c, carry):
            pages = jax.lax.dynamic_slice_in_dim(rows, c * ppw, ppw, axis=1)  # [tb, ppw]
            kpos = jnp.broadcast_to(c * ckw + jnp.arange(ckw, dtype=jnp.int32), (tb, ckw))
            skip = (c < lo_whole) | (c >= n_whole)  # outside this token's whole chunks: a no-op
            return step(carry, qg, pages=pages, kpos=kpos, qpos=jnp.where(skip, -1, pos))

        def tail(j, carry):
            first = n_whole * ckw + j * ckt  # [tb] each token's first key of its j-th tail chunk
            pidx = jnp.minimum(first[:, None] // P + jnp.arange(ppt), last_page)  # [tb, ppt]
            pages = jnp.take_along_axis(rows, pidx, axis=1)
            kpos = first[:, None] + jnp.arange(ckt, dtype=jnp.int32)
            skip = (j < lo_tail) | (j >= n_tail)
            return step(carry, qg, pages=pages, kpos=kpos, qpos=jnp.where(skip, -1, pos))

        carry = (*_softmax_init(sinks, (tb, KH, G)), jnp.zeros((tb, KH, G, D)))
        carry = jax.lax.fori_loop(jnp.min(lo_whole), jnp.max(n_whole), whole, carry)
        _, l, acc = jax.lax.fori_loop(jnp.min(lo_tail), jnp.max(n_tail), tail, carry)
        o = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(tb, H, D)
        return out.at[ti].set(o.astype(out.dtype), mode="drop")

    if idx.shape[0] == tb:  # one block: no loop; skipped when no token takes this path (prompt chunks only)
        return jax.lax.cond(count > 0, functools.partial(block, 0), lambda out: out, out)
    return jax.lax.fori_loop(0, (count + tb - 1) // tb, block, out)


def _block_path(out, q, k_pages, v_pages, lay, md, w, *, scale, sliding_window, soft_cap, sinks):
    """Query-block attention for the host's items (runs of one sequence's tokens), written into out [T, H, D].
    sinks: [KH, G] float32 or None."""
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G, B = H // KH, QUERY_BLOCK
    ppc = max(1, _BLOCK_KEY_CHUNK // P)
    ck = ppc * P
    bt = _pad_pages(md.block_tables, ppc)
    ig = min(_ITEM_GROUP, w.item_start.shape[0])
    starts, lens, seqs = w.item_start, w.item_len, w.item_seq
    if starts.shape[0] % ig:
        extra = ig - starts.shape[0] % ig
        starts, lens, seqs = (jnp.pad(a, (0, extra)) for a in (starts, lens, seqs))

    def group(g, out):
        st, ln, sq = (jax.lax.dynamic_slice_in_dim(a, g * ig, ig) for a in (starts, lens, seqs))  # [ig]
        live = jnp.arange(B)[None, :] < ln[:, None]  # [ig, B]
        ti = jnp.where(live, st[:, None] + jnp.arange(B)[None, :], T)  # [ig, B]
        tc = jnp.minimum(ti, T - 1)
        pos = jnp.where(live, lay.q_pos[tc], -1)  # [ig, B]
        qg = q[tc].astype(jnp.float32).reshape(ig, B, KH, G, D).transpose(0, 2, 1, 3, 4) * scale
        qg = qg.reshape(ig, KH, B * G, D)  # [ig, KH, B*G, D]
        qpos = jnp.repeat(pos, G, axis=1)[:, None, :, None]  # [ig, 1, B*G, 1]
        rows = bt[sq]  # [ig, pages]
        lo = jnp.min(jnp.where(live, pos, jnp.iinfo(jnp.int32).max))
        hi = (jnp.max(pos) + ck) // ck

        def body(c, carry):
            m, l, acc = carry  # [ig, KH, B*G], same, [ig, KH, B*G, D]
            pages = jax.lax.dynamic_slice_in_dim(rows, c * ppc, ppc, axis=1)  # [ig, ppc]
            k = take_pages(k_pages, pages).reshape(ig, ck, KH, D)  # float32, de-quantized if the cache is
            v = take_pages(v_pages, pages).reshape(ig, ck, KH, D)
            kpos = (c * ck + jnp.arange(ck, dtype=jnp.int32))[None, None, None, :]  # [1, 1, 1, ck]
            s = jnp.einsum("ikqd,ickd->ikqc", qg, k)  # [ig, KH, B*G, ck]
            s, mask = masked_scores(s, kpos, qpos, sliding_window, soft_cap)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum("ikqc,ickd->ikqd", p, v)

        block_sinks = None if sinks is None else jnp.tile(sinks, (1, B))  # [KH, B*G], row b * G + g
        init = (*_softmax_init(block_sinks, (ig, KH, B * G)), jnp.zeros((ig, KH, B * G, D)))
        _, l, acc = jax.lax.fori_loop(_first_chunk(lo, sliding_window, ck), hi, body, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [ig, KH, B*G, D]
        o = o.reshape(ig, KH, B, G, D).transpose(0, 2, 1, 3, 4).reshape(ig * B, H, D)
        return out.at[ti.reshape(-1)].set(o.astype(out.dtype), mode="drop")

    if starts.shape[0] == ig:  # one group: no loop; skipped when the step has no query block (decodes only)
        return jax.lax.cond(w.num_items > 0, functools.partial(group, 0), lambda out: out, out)
    return jax.lax.fori_loop(0, (w.num_items + ig - 1) // ig, group, out)


def paged_attention_reference(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Plain-jnp ragged paged attention with an online softmax over fixed-size key chunks.

    Tokens go per token or per query block as `md.work` says (every token per token when it is absent). Loops run
    for as many chunks as the contexts need (dynamic trip counts, so cost follows the real lengths and no
    context-length bucket is compiled). A per-token row's chunks depend on its own position only (see
    `_token_path`), whether decoded alone, beside other sequences or inside a speculative run. Query
    blocks' chunk boundaries are absolute positions: extra chunks of a longer companion are fully masked for them.

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] already holding this
    step's keys, float or `QuantizedPages` (each gathered chunk de-quantized to float32); sinks: [q_heads]
    attention-sink logits (gpt-oss) or None: each head's softmax also spans its sink, which is neither scaled nor
    soft-capped and carries no value. Returns [T, q_heads, head_dim] in q's dtype; padding tokens give zeros. Math in
    float32.
    """
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return attend_by_work(q, k_pages, v_pages, md, _token_path, **kw)


def attend_by_work(q, k_pages, v_pages, md, token_path, *, scale, sliding_window, soft_cap, sinks):
    """The reference's split of a step's tokens: `token_path` for the per-token rows, `_block_path` for the rest."""
    T, H, D = q.shape
    KH = k_pages.shape[2]
    lay = with_token_layout(md, T).layout
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    sinks = None if sinks is None else sinks.reshape(KH, H // KH)
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    out = jnp.zeros((T, H, D), q.dtype)
    if md.work is None:
        idx = jnp.arange(T, dtype=jnp.int32)
        return token_path(out, q, k_pages, v_pages, lay, idx, jnp.int32(T), **kw)
    w = md.work
    out = token_path(out, q, k_pages, v_pages, lay, w.tokens, w.num_tokens, **kw)
    return _block_path(out, q, k_pages, v_pages, lay, md, w, **kw)
