"""The one attention entry point over the paged KV cache, and the KV write. A flat ragged token batch (many
sequences' new tokens concatenated) attends to each sequence's pages through its block table; plain jnp here.

Differentiation: `attention` is reverse-mode differentiable on every backend, with respect to q, the K/V pages and
the sinks. Its forward is the selected backend's call unchanged (a jit without differentiation compiles exactly the
backend); its backward is the VJP of `paged_attention_dense`, a fixed-shape jnp reference of the same attention (the
reference's dynamic-length loops and the Pallas kernels have no backward of their own). The backward's memory is
dense: per call, each token's whole block table of keys and values gathered in float32, [T, max_pages * page_size,
kv_heads, head_dim] each (once, without the T, for a batch of one sequence), and its scores and probabilities
[T, q_heads, max_pages * page_size] float32, so it suits training-style use (short sequences, small block tables),
not serving-size batches. Forward-mode (jvp) is not provided."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from netra_jax.ops import cpu_attention, cpu_kernels
from netra_jax.ops.attention_args import check_attention_args
from netra_jax.ops.paged_attention_mosaic import (
    paged_attention_mosaic,
    paged_attention_mosaic_interpret,
    supports,
)
from netra_jax.ops.paged_attention_triton import paged_attention_triton, paged_attention_triton_interpret

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
_QUERY_BLOCK = 32
_BLOCK_KEY_CHUNK = 128
_ITEM_GROUP = 16
_NEG = -1e30


@flax.struct.dataclass
class TokenLayout:
    """Per-token view of a step's ragged batch, derived once per step and shared by every layer."""

    seq_idx: jax.Array  # [T] int32 sequence of each token (clamped into range for padding tokens)
    q_pos: jax.Array  # [T] int32 absolute position of each token (0 for padding)
    valid: jax.Array  # [T] bool real (non-padding) token
    rows: jax.Array  # [T, max_pages] int32 block-table row of each token's sequence


@flax.struct.dataclass
class AttentionWork:
    """Host-built split of a step's tokens between the reference's two paths. N = num_items(T, S)."""

    tokens: jax.Array  # [T] int32 tokens of single-token (decode) sequences first, the rest padded with T
    num_tokens: jax.Array  # [] int32 how many entries of `tokens` are real
    item_start: jax.Array  # [N] int32 first token of each query block (runs of <= _QUERY_BLOCK tokens of one seq)
    item_len: jax.Array  # [N] int32 tokens in the block (0 for padding items, which come last)
    item_seq: jax.Array  # [N] int32 the block's sequence
    num_items: jax.Array  # [] int32 real items


@flax.struct.dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch. T = padded token count, S = padded sequence count."""

    slot_mapping: jax.Array  # [T] int32 flat KV slot (page * page_size + offset) for each new token; padding >= slots
    query_start_loc: jax.Array  # [S + 1] int32 cumulative query lengths; padding sequences have length 0
    seq_lens: jax.Array  # [S] int32 context length of each sequence after this step (cached + new); 0 for padding
    block_tables: jax.Array  # [S, max_pages] int32 page ids of each sequence; unused entries 0
    layout: TokenLayout | None = None  # filled by `with_token_layout`; the reference derives it when absent
    work: AttentionWork | None = None  # host-built path split (reference only); absent: every token per token


def num_items(num_tokens: int, num_seqs: int) -> int:
    """Static bound on the query blocks of a step: each sequence's run splits into ceil(len / _QUERY_BLOCK)."""
    return -(-num_tokens // _QUERY_BLOCK) + num_seqs


def build_work(q_lens, num_tokens: int, num_seqs: int, per_token=None) -> tuple[np.ndarray, ...]:
    """Numpy work lists for `AttentionWork` from the real sequences' query lengths (in batch order): single-token
    sequences go to the per-token path, longer runs are cut into query blocks. `per_token[s]` True sends every token
    of sequence s to the per-token path (speculative verification: each token then gets exactly the arithmetic it
    gets when decoded alone)."""
    n_items = num_items(num_tokens, num_seqs)
    tokens = np.full(num_tokens, num_tokens, np.int32)
    start = np.zeros(n_items, np.int32)
    length = np.zeros(n_items, np.int32)
    seq = np.zeros(n_items, np.int32)
    t = nt = ni = 0
    for s, n in enumerate(q_lens):
        if n == 1 or (per_token is not None and per_token[s]):
            tokens[nt : nt + n] = np.arange(t, t + n)
            nt += n
        else:
            for o in range(0, n, _QUERY_BLOCK):
                start[ni], length[ni], seq[ni] = t + o, min(_QUERY_BLOCK, n - o), s
                ni += 1
        t += n
    return tokens, np.int32(nt), start, length, seq, np.int32(ni)


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


def _masked_scores(s, kpos, qpos, sliding_window, soft_cap):
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

    def fetch(pages_array):  # [t, ck, KH, 1, D] float32
        # clip mode: page ids are in range by construction, and it gathers far faster than checked indexing
        # (pages as rows of one 2-D array: each page one contiguous copy, faster than a 4-D gather on CPU)
        rows = pages_array.reshape(pages_array.shape[0], -1)
        x = jnp.take(rows, pages, axis=0, mode="clip").reshape(t, ck, KH, 1, D)
        return x.astype(jnp.float32)

    # a multiply-and-sum (one fused loop over the gathered keys) rather than a batched dot: measured faster on CPU
    s = (fetch(k_pages) * qg[:, None]).sum(-1).transpose(0, 2, 3, 1)  # [t, KH, G, ck]
    s, mask = _masked_scores(s, kpos[:, None, None, :], qpos[:, None, None, None], sliding_window, soft_cap)
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
    G, B = H // KH, _QUERY_BLOCK
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
            k = jnp.take(k_pages, pages, axis=0, mode="clip").reshape(ig, ck, KH, D).astype(jnp.float32)
            v = jnp.take(v_pages, pages, axis=0, mode="clip").reshape(ig, ck, KH, D).astype(jnp.float32)
            kpos = (c * ck + jnp.arange(ck, dtype=jnp.int32))[None, None, None, :]  # [1, 1, 1, ck]
            s = jnp.einsum("ikqd,ickd->ikqc", qg, k)  # [ig, KH, B*G, ck]
            s, mask = _masked_scores(s, kpos, qpos, sliding_window, soft_cap)
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
    k_pages: jax.Array,
    v_pages: jax.Array,
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

    q: [T, q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] (already holding this
    step's keys); sinks: [q_heads] attention-sink logits (gpt-oss) or None: each head's softmax also spans its sink,
    which is neither scaled nor soft-capped and carries no value. Returns [T, q_heads, head_dim] in q's dtype; padding
    tokens give zeros. Math in float32.
    """
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return _paged_attention(q, k_pages, v_pages, md, _token_path, **kw)


def _paged_attention(q, k_pages, v_pages, md, token_path, *, scale, sliding_window, soft_cap, sinks):
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


def _kernel_token_path(out, q, k_pages, v_pages, lay, idx, count, *, scale, sliding_window, soft_cap, sinks):
    """`_token_path` on the C++ kernel (`netra_jax.ops.cpu_attention`): out [T, H, D] holds zeros and is replaced."""
    return cpu_attention.token_attention(
        q,
        k_pages,
        v_pages,
        idx,
        count,
        lay.q_pos,
        lay.valid,
        lay.rows,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
    ).astype(out.dtype)


def paged_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`paged_attention_reference` with its per-token rows on the C++ kernel of `netra_jax.ops.cpu_attention`, for
    float32 queries and pages when the kernels are built (else the reference itself). The kernel takes the reference's
    per-token rows (decodes, speculative runs) and every token of a sequence whose context is at most
    `CPU_TOKEN_CONTEXT` keys (its keys stay in cache for its whole prompt chunk); query blocks of longer sequences
    keep the jnp block path, which shares each gathered chunk of keys between 32 queries. Which path a token takes
    depends on its own sequence only, so a request's result does not depend on its batch. Same arguments and result
    as the reference, up to float rounding; lowers for CPU only."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if not (cpu_attention.takes(q, k_pages) and cpu_kernels.available()):
        return paged_attention_reference(q, k_pages, v_pages, md, **kw)
    if md.work is not None:
        md = md.replace(work=_short_runs_per_token(with_token_layout(md, q.shape[0]), CPU_TOKEN_CONTEXT))
    return _paged_attention(q, k_pages, v_pages, md, _kernel_token_path, **kw)


# The "cpu" backend's kernel takes every token of sequences with at most this context. Measured on SmolLM2 (2-core
# Xeon), a prompt's prefill step with its attention on the kernel against the block path: 128 tokens 160 against
# 189 ms, 256 tokens 296 against 322; 384 tokens 554 against 546, 1000 tokens 1656 against 1339.
CPU_TOKEN_CONTEXT = 256


def _short_runs_per_token(md: AttentionMetadata, limit: int) -> AttentionWork:
    """md's work lists with every token of the sequences of at most `limit` keys moved to the per-token list (their
    query blocks emptied, the remaining blocks first)."""
    w, lay = md.work, md.layout
    T = lay.valid.shape[0]
    short = md.seq_lens <= limit  # [S]
    take = jnp.zeros(T, bool).at[w.tokens].set(True, mode="drop") | (lay.valid & short[lay.seq_idx])  # [T]
    (tokens,) = jnp.nonzero(take, size=T, fill_value=T)  # [T], in token order
    kept = (w.item_len > 0) & ~short[w.item_seq]  # [N] blocks of long sequences
    order = jnp.argsort(~kept, stable=True)  # kept blocks first
    return AttentionWork(
        tokens=tokens.astype(jnp.int32),
        num_tokens=take.sum().astype(jnp.int32),
        item_start=w.item_start[order],
        item_len=jnp.where(kept, w.item_len, 0)[order],
        item_seq=w.item_seq[order],
        num_items=kept.sum().astype(jnp.int32),
    )


def cpu_backend() -> str:
    """The backend "auto" runs on CPU: "cpu" (the reference with its per-token rows on the C++ kernel) when the
    kernels build, else "reference"."""
    return "cpu" if cpu_kernels.available() else "reference"


def auto_backend(
    platform: str, compute_capability: str | None, *, dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size
) -> str:
    """The backend "auto" runs: the Mosaic GPU kernel on Hopper (sm90: its wgmma exists there only, not on
    Blackwell) for the dtypes and shapes it takes (bf16/fp16 queries and cache, head_dim a multiple of 64, see
    `paged_attention_mosaic.supports`), the Triton kernel on other GPUs and shapes; on CPU the "cpu" backend (the
    reference with its per-token rows on the C++ kernel) when the kernels build, else the jnp reference.
    compute_capability: the device's, e.g. "9.0"."""
    if platform == "cpu":
        return cpu_backend()
    if platform != "gpu":
        return "reference"
    hopper = compute_capability is not None and compute_capability.split(".")[0] == "9"
    if hopper and supports(dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size) is None:
        return "mosaic"
    return "triton"


def _auto(q, k_pages, v_pages, md, **kw):
    """The backend `auto_backend` picks for this device and these (static) shapes."""
    dev = jax.devices()[0]
    name = auto_backend(
        jax.default_backend(),
        getattr(dev, "compute_capability", None),
        dtype=q.dtype,
        kv_dtype=k_pages.dtype,
        q_heads=q.shape[1],
        kv_heads=k_pages.shape[2],
        head_dim=q.shape[2],
        page_size=k_pages.shape[1],
    )
    return BACKENDS[name](q, k_pages, v_pages, md, **kw)


BACKENDS = {
    "reference": paged_attention_reference,
    "cpu": paged_attention_cpu,
    "triton": paged_attention_triton,
    "triton_interpret": paged_attention_triton_interpret,
    "mosaic": paged_attention_mosaic,
    "mosaic_interpret": paged_attention_mosaic_interpret,
    "auto": _auto,
}


def paged_attention_dense(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention with fixed shapes and no loops: the differentiable reference `attention`'s backward
    is the VJP of. Same arguments, masks (causal, sliding window, soft-cap, sinks) and result as
    `paged_attention_reference`; `md.work` is ignored.

    Every token gathers its sequence's whole block table: keys and values [T, max_pages * page_size, kv_heads,
    head_dim] float32 (once, [max_pages * page_size, kv_heads, head_dim], when the batch is one sequence, as
    `models.transformer.forward_dense`'s), scores [T, q_heads, max_pages * page_size] float32: memory grows with T
    times the block table's width (see the module docstring). Differentiable (reverse and forward mode) in q,
    k_pages, v_pages and sinks; softmax in float32.
    """
    T, H, D = q.shape
    _, P, KH, _ = k_pages.shape
    G = H // KH
    sinks = check_attention_args(q, k_pages, v_pages, sliding_window, sinks)
    lay = with_token_layout(md, T).layout
    K = lay.rows.shape[1] * P  # keys of a whole block table
    one = md.block_tables.shape[0] == 1  # one sequence: every token's keys are the same, gathered once
    rows, keys = (md.block_tables[0], "ckd") if one else (lay.rows, "tckd")  # [(T,) max_pages]

    def gather(pages):  # [(T,) K, KH, D] float32: the (each token's) sequence's keys or values in position order
        return jnp.take(pages, rows, axis=0, mode="clip").reshape(*rows.shape[:-1], K, KH, D).astype(jnp.float32)

    qg = q.astype(jnp.float32).reshape(T, KH, G, D) * scale
    s = jnp.einsum(f"tkgd,{keys}->tkgc", qg, gather(k_pages), precision=jax.lax.Precision.HIGHEST)  # [T, KH, G, K]
    qpos = jnp.where(lay.valid, lay.q_pos, -1)[:, None, None, None]  # padding tokens see no key
    s, mask = _masked_scores(s, jnp.arange(K, dtype=jnp.int32), qpos, sliding_window, soft_cap)
    m = s.max(-1)  # [T, KH, G]
    if sinks is not None:
        sk = jnp.broadcast_to(sinks.reshape(KH, G), m.shape)  # [T, KH, G]
        m = jnp.maximum(m, sk)
    m = jax.lax.stop_gradient(m)  # the softmax does not depend on it
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)  # [T, KH, G, K]
    l = p.sum(-1) if sinks is None else p.sum(-1) + jnp.exp(sk - m)
    o = jnp.einsum(f"tkgc,{keys}->tkgd", p, gather(v_pages), precision=jax.lax.Precision.HIGHEST)  # [T, KH, G, D]
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return o.reshape(T, H, D).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    """`backend`'s attention, differentiated as `paged_attention_dense`. backend: the BACKENDS key (static)."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return BACKENDS[backend](q, k_pages, v_pages, md, **kw)


def _with_dense_vjp_fwd(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks):
    out = _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)
    return out, (q, k_pages, v_pages, md, sinks)


def _with_dense_vjp_bwd(backend, scale, sliding_window, soft_cap, res, g):
    q, k_pages, v_pages, md, sinks = res

    def dense(q, k_pages, v_pages, sinks):
        kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        return paged_attention_dense(q, k_pages, v_pages, md, **kw)

    _, vjp = jax.vjp(dense, q, k_pages, v_pages, sinks)
    dq, dk, dv, dsinks = vjp(g)
    return dq, dk, dv, None, dsinks  # the integer metadata has no cotangent


_with_dense_vjp.defvjp(_with_dense_vjp_fwd, _with_dense_vjp_bwd)


def attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    backend: str = "reference",
) -> jax.Array:
    """Ragged paged attention through the selected backend (see `BACKENDS`). Shapes as in the reference.

    Reverse-mode differentiable on every backend with respect to q, k_pages, v_pages and sinks (zero for the
    metadata): the forward is the backend's, the backward `paged_attention_dense`'s (see the module docstring for
    its memory cost).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
    return _with_dense_vjp(backend, scale, sliding_window, soft_cap, q, k_pages, v_pages, md, sinks)
