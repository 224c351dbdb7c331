"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): each token is routed to its top-k experts, and the experts
run as grouped matmuls (`grouped_matmul`: a blocked loop on CPU, a Pallas kernel on CUDA) over the (token, expert)
rows sorted by expert, with static shapes.

Parameters of a MoE layer (see `models.transformer`): router [hidden, experts], optional router_bias [experts],
experts_gate_up [experts, hidden, 2, moe_intermediate], experts_down [experts, moe_intermediate, hidden] (float, or
quantized per expert: `quant.QuantizedWeight` / `quant.GGMLWeight` with the experts as their batch axis), optional
experts_gate_up_bias [experts, 2, moe_intermediate] and experts_down_bias [experts, hidden].
Differentiable in forward and reverse mode and vmap-able, derivatives included (see `grouped_matmul`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec as P

from netra_jax.config import ModelConfig
from netra_jax.models.weight_map import TP, param_specs
from netra_jax.ops import cpu_ggml_matmul, cpu_matmul, ggml_blocks
from netra_jax.ops.grouped_matmul_triton import grouped_matmul_triton
from netra_jax.ops.invariant import tree_logsumexp, tree_softmax
from netra_jax.quant import CPU_BACKENDS, ROW_INVARIANT, GGMLWeight, QuantizedWeight, matmul
from netra_jax.quant.cpu_rows import ggml_int8_x

MOE_KEYS = ("router", "router_bias", "experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")


def route(x: jax.Array, lp: dict, cfg: ModelConfig, mb: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Top-k routing in float32. x: [T, hidden]. Returns (weights [T, k] float32, experts [T, k] int32).

    The k largest router logits pick the experts (softmax is monotonic, so these are the k most probable ones);
    weights are their softmax probabilities over all experts, renormalised to sum to 1 when `cfg.norm_topk_prob`
    (Mixtral, gpt-oss, most Qwen3-MoE) — which is the softmax over the k chosen logits, computed as such.
    mb: the matmul backend; a batch-invariant one (`quant.ROW_INVARIANT`) runs the router's product on its kernel
    and sums the softmax in a fixed order, so a token's routing never depends on the other tokens."""
    if mb in ROW_INVARIANT:
        logits = matmul(x, lp["router"], preferred_element_type=jnp.float32, backend=mb)  # [T, experts]
    else:
        logits = jnp.dot(x, lp["router"].astype(x.dtype), preferred_element_type=jnp.float32)  # [T, experts]
    if "router_bias" in lp:
        logits = logits + lp["router_bias"].astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)  # [T, k], largest first
    if cfg.norm_topk_prob:
        weights = tree_softmax(top) if mb in ROW_INVARIANT else jax.nn.softmax(top, axis=-1)
    elif mb in ROW_INVARIANT:
        weights = jnp.exp(top - tree_logsumexp(logits)[:, None])
    else:
        weights = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return weights, experts.astype(jnp.int32)


def expert_activation(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The gated activation of the expert MLPs. gate, up: [rows, moe_intermediate]."""
    if cfg.expert_act == "silu":
        return jax.nn.silu(gate) * up
    if cfg.expert_act == "swiglu_oai":  # gpt-oss: clamped, with a sigmoid slope and a +1 on up
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
    raise ValueError(f"unknown expert activation {cfg.expert_act!r}")


def _group_of_rows(rows: int, group_sizes: jax.Array) -> jax.Array:
    """[rows] each row's group under group_sizes [G] (rows sorted by group); G for rows past the last group."""
    ends = jnp.cumsum(group_sizes)  # [G]
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right", method="compare_all")


def _inverse_permutation(order: jax.Array) -> jax.Array:
    """The inverse of permutation `order` [N]: x[order][_inverse_permutation(order)] == x."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _with_batch_folded(fn: Callable[[jax.Array, Any, jax.Array], jax.Array]) -> Callable:
    """fn(rows [R, K] sorted by group, w, group_sizes [G]) -> [R, N] (a grouped matmul, w a float or quantized
    weight with the groups as its batch axis), with a vmap rule: a batch of row sets (each sorted by group, with its
    own group sizes) over one w is one call of fn on all the rows, sorted by group across the batch (stable: each
    group's rows stay in batch order), with the group sizes summed, and the result put back in place; the kernels
    and the CPU loop have no batching rule of their own (jax has none for `jax.lax.ragged_dot`). A batch of weights
    runs as a loop of single calls (`jax.lax.map`)."""
    fn = jax.custom_batching.custom_vmap(fn)

    @fn.def_vmap
    def rule(axis_size, in_batched, rows, w, group_sizes):
        rows_b, w_b, sizes_b = in_batched
        if any(jax.tree.leaves(w_b)):  # each example its own matrices

            def one(i):  # example i's call
                def take(a, batched):
                    return a[i] if batched else a

                return fn(*jax.tree.map(take, (rows, w, group_sizes), tuple(in_batched)))

            return jax.lax.map(one, jnp.arange(axis_size)), True
        B, R, K = axis_size, rows.shape[-2], rows.shape[-1]
        rows = rows if rows_b else jnp.broadcast_to(rows, (B, R, K))  # [B, R, K]
        sizes = group_sizes if sizes_b else jnp.broadcast_to(group_sizes, (B, *group_sizes.shape))  # [B, G]
        group = jax.vmap(functools.partial(_group_of_rows, R))(sizes)  # [B, R]
        order = jnp.argsort(group.reshape(-1), stable=True)  # [B * R] (group, example, row) order
        y = fn(rows.reshape(B * R, K)[order], w, sizes.sum(0))  # [B * R, N]
        return y[_inverse_permutation(order)].reshape(B, R, -1), True

    return fn


@jax.checkpoint
def _grouped_matmul_masked(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul as the product of every row with every group's matrix, each row masked to its own group's (a
    [G, R, K] copy of the rows, G times the FLOPs): what `jax.lax.ragged_dot` lowers to on CPU and CUDA, in plain
    jnp, so jax batches it (under vmap, jacfwd), transposes it and differentiates it again. The derivatives of the
    grouped matmuls; rematerialized, so reverse mode keeps its inputs and not the masked copy. Rows past the last
    group come out zero."""
    G, R = w.shape[0], rows.shape[0]
    group = _group_of_rows(R, group_sizes)  # [R]
    mask = group[None, :] == jnp.arange(G, dtype=group.dtype)[:, None]  # [G, R]
    masked = jnp.where(mask[:, :, None], rows[None], jnp.zeros((), rows.dtype))  # [G, R, K]
    return jnp.einsum("grk,gkn->rn", masked, w.astype(rows.dtype)).astype(rows.dtype)


def _grouped_matmul_platform(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(
        rows, w, group_sizes, cpu=_grouped_matmul_blocks, cuda=grouped_matmul_triton, default=jax.lax.ragged_dot
    )


@jax.custom_jvp
def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [R, K] sorted by group, w [G, K, N], group_sizes [G] (summing to R) -> [R, N]: each row times its
    group's matrix. CPU and CUDA lower `jax.lax.ragged_dot` to one product of every row with every group's matrix,
    masked (G times the FLOPs and a [R, G, K] copy of the rows; a decode step reads every expert), so CPU runs
    `_grouped_matmul_blocks` (measured 3-15x faster for 8 experts of 1024 x 1024, from 512 to 2 rows) and CUDA the
    Pallas kernel `ops.grouped_matmul_triton` (a Qwen3-30B-A3B step of 2048 tokens: 8 GiB of temporaries less);
    other platforms keep ragged_dot.

    Differentiable in rows and w on every platform, forward and reverse mode, to any order: the tangent is the
    masked product `_grouped_matmul_masked` (the blocked loop's data-dependent trip counts and the kernel have no
    derivative of their own), so derivatives cost the product of every row with every group. vmap-able, its
    derivatives included: a batch is one call over all its rows (`_with_batch_folded`)."""
    return _grouped_matmul_folded(rows, w, group_sizes)


_grouped_matmul_folded = _with_batch_folded(_grouped_matmul_platform)


@functools.partial(grouped_matmul.defjvp, symbolic_zeros=True)
def _grouped_matmul_jvp(primals, tangents):
    rows, w, group_sizes = primals
    d_rows, d_w, _ = tangents  # bilinear in rows and w; the integer group sizes have no tangent
    tangent = None
    if not isinstance(d_rows, SymbolicZero):
        tangent = _grouped_matmul_masked(d_rows, w, group_sizes)
    if not isinstance(d_w, SymbolicZero):
        d_out = _grouped_matmul_masked(rows, d_w, group_sizes)
        tangent = d_out if tangent is None else tangent + d_out
    out = grouped_matmul(rows, w, group_sizes)
    return out, jnp.zeros_like(out) if tangent is None else tangent


def _block_rows(rows: int, groups: int) -> int:
    """Rows per block: a group's even share rounded up to a power of two, within [8, 64]."""
    share = -(-rows // groups)
    return min(64, max(8, 1 << (share - 1).bit_length()))


# A group's product: group index -> (block of rows [B, K] -> [B, N]), prepared once per group that has rows.
GroupProduct = Callable[[jax.Array], Callable[[jax.Array], jax.Array]]


def _grouped_matmul_blocks(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul of a float w [G, K, N] on `_grouped_blocks`: each block a dot with the group's matrix."""

    def product(g):
        wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # [K, N], taken once for all the group's blocks
        return lambda x: jnp.dot(x, wg)

    return _grouped_blocks(rows, group_sizes, w.shape[0], w.shape[2], product)


def _grouped_blocks(rows: jax.Array, group_sizes: jax.Array, groups: int, n: int, product: GroupProduct) -> jax.Array:
    """The grouped product as a loop over groups and, inside, over blocks of the group's rows: each block is one
    [B, K] -> [B, N] `product` of the group, so the work follows the rows each group has (a group without rows
    is skipped, its matrix not even read). Both loops are `fori_loop`s with data trip counts: the shapes stay
    static and the program's size does not grow with the number of groups (unrolled over 128 experts, one layer
    took 6 s to compile; as a loop 0.3 s, and it runs as fast)."""
    R, K = rows.shape
    B = _block_rows(R, groups)
    starts = jnp.cumsum(group_sizes) - group_sizes  # [G] first row of each group
    padded = jnp.concatenate([rows, jnp.zeros((B, K), rows.dtype)])  # [R + B, K]: a block never reads past the end
    out = jnp.zeros((R + B, n), rows.dtype)

    def group(g, out):  # in group order: rows a block writes past its group's end belong to later groups
        def run(out):
            mul = product(g)

            def block(b, out):
                r = starts[g] + b * B
                y = mul(jax.lax.dynamic_slice_in_dim(padded, r, B))  # [B, N]
                return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), r, 0)

            return jax.lax.fori_loop(0, (group_sizes[g] + B - 1) // B, block, out)

        return jax.lax.cond(group_sizes[g] > 0, run, lambda out: out, out)

    return jax.lax.fori_loop(0, groups, group, out)[:R]


def _flat_experts(w):
    """An expert weight [E, K, *out] (float or quantized) with its output axes flattened: [E, K, N]."""
    if isinstance(w, QuantizedWeight):
        E, K = w.q.shape[:2]
        return w.replace(q=w.q.reshape(E, K, -1), scale=w.scale.reshape(E, -1))
    if isinstance(w, GGMLWeight):
        return w.replace(data=w.data.reshape(w.data.shape[0], -1, w.data.shape[-1]))  # [E, N, row_bytes]
    return w.reshape(*w.shape[:2], -1)


def expert_matmul(rows: jax.Array, w, group_sizes: jax.Array, expert: jax.Array, mb: str = "xla") -> jax.Array:
    """rows [R, K] sorted by expert times each row's expert's matrix of w [E, K, N]: a float array (`grouped_matmul`)
    or a quantized weight with one batch axis, the experts (`quant.QuantizedWeight`: its int8/fp8 values widened per
    group, the per-expert scales of each row's expert applied after the grouped matmul; `quant.GGMLWeight`: each
    group's blocks de-quantized, or read by the CPU kernel when mb is "cpu_rows", see `_grouped_quantized`).
    expert: [R] each row's expert. Returns [R, N] in rows' dtype."""
    if isinstance(w, QuantizedWeight):
        y = _grouped_quantized(rows, w.q, group_sizes, mb)  # [R, N]
        return y * w.scale[expert].astype(y.dtype)
    if isinstance(w, GGMLWeight):
        if mb in ROW_INVARIANT:
            raise ValueError(f"matmul_backend {mb!r} does not multiply GGML-quantized experts ({w.qtype})")
        return _grouped_quantized(rows, w, group_sizes, mb)
    if mb in ROW_INVARIANT:  # float32 or bfloat16 experts read as stored
        return grouped_matmul_invariant(rows, w, group_sizes)
    return grouped_matmul(rows, w.astype(rows.dtype), group_sizes)


@jax.custom_jvp
def grouped_matmul_invariant(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` for the batch-invariant backend: each block of a group's rows on `quant.matmul`'s
    "cpu_invariant" kernel, so a row's result depends on the row and its group's matrix alone (not on how many rows
    the groups have). w: float32 or bfloat16 [G, K, N]; the result in rows' dtype. Differentiable in rows and w (the
    tangent is `jax.lax.ragged_dot`'s); CPU only."""

    def product(g):
        wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # [K, N]
        return lambda x: matmul(x, wg, backend="cpu_invariant")

    return _grouped_blocks(rows, group_sizes, w.shape[0], w.shape[2], product)


@grouped_matmul_invariant.defjvp
def _grouped_matmul_invariant_jvp(primals, tangents):
    rows, w, group_sizes = primals
    d_rows, d_w, _ = tangents  # bilinear in rows and w; the integer group sizes have no tangent
    dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes)
    tangent = dot(d_rows, w.astype(rows.dtype)) + dot(rows, d_w.astype(rows.dtype))
    return grouped_matmul_invariant(rows, w, group_sizes), tangent


def _group_product(w, dtype, mb: str, block: int) -> GroupProduct:
    """The product of a block of `block` rows with group g of quantized experts: int8/fp8 values [E, K, N] widened
    to `dtype` (with mb "cpu_rows", int8 times float32 blocks of up to 32 rows on `ops.cpu_matmul`'s few-row
    kernel), or GGML blocks [E, N, row_bytes] read by the CPU kernel (mb "cpu_rows", float32 rows it takes:
    `ops.cpu_ggml_matmul`, de-quantizing in registers) or else de-quantized to [N, K] and contracted on K.
    The kernels pay at every block size the loop uses (8-64 rows). Gate/up of 32 experts of 2048 x 1536, 8 experts
    a token, on a shared 2-core Xeon (one run each, noisy), Q4_0 kernel / Q4_0 de-quantized per expert / float32
    experts: 1 token 16 / 66 / 87 ms, 8 tokens 92 / 310 / 266 ms, 64 tokens 208 / 820 / 689 ms, 512 tokens 1520 /
    1704 / 1664 ms; int8 kernel / widened per expert: 1 token 6.1 / 38.7 ms, 8 tokens 39 / 142 ms, 64 tokens 76 /
    231 ms."""
    if not isinstance(w, GGMLWeight):

        def widened(g):
            wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # [K, N], only this group's
            if mb in ROW_INVARIANT:  # the int8 / fp8 values on the batch-invariant kernel, any block size
                return lambda x: cpu_matmul.invariant_matmul(x.astype(jnp.float32), wg).astype(x.dtype)
            if mb in CPU_BACKENDS:  # int8 values on the few-row kernel when it takes the block, else widened
                return lambda x: cpu_matmul.rows_matmul(x, wg)
            wg = wg.astype(dtype)
            return lambda x: jnp.dot(x, wg)

        return widened
    data, qtype = w.data, w.qtype
    x, one = jax.ShapeDtypeStruct((block, w.k), dtype), jax.ShapeDtypeStruct(data.shape[1:], data.dtype)
    q8 = ggml_int8_x(qtype, mb == "cpu_rows_q8")
    if mb in CPU_BACKENDS and cpu_ggml_matmul.takes(x, one, qtype, q8):

        def kernel(g):
            blocks = jax.lax.dynamic_index_in_dim(data, g, keepdims=False)  # [N, row_bytes], only this group's
            return lambda x: cpu_ggml_matmul.blocks_matmul(x, blocks, qtype, q8)

        return kernel

    def dequantized(g):
        r = ggml_blocks.dequantize_rows(jax.lax.dynamic_index_in_dim(data, g, keepdims=False), qtype, dtype)  # [N, K]
        return lambda x: jax.lax.dot_general(x, r, (((1,), (1,)), ((), ())))

    return dequantized


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _grouped_quantized(rows: jax.Array, w, group_sizes: jax.Array, mb: str) -> jax.Array:
    """rows [R, K] times each group's matrix of quantized experts w (int8/fp8 values [E, K, N] or GGML blocks with
    data [E, N, row_bytes]) on `_grouped_blocks` on every platform: only the experts that have rows are read and
    de-quantized (this is also the reference the CPU kernel's path is tested against). Differentiable in rows
    (forward and reverse, any order: the tangent is `_grouped_matmul_masked`'s with the de-quantized weights,
    linear in rows), not in w; vmap-able as `grouped_matmul` is."""
    return _quantized_blocks(mb)(rows, w, group_sizes)


@functools.cache
def _quantized_blocks(mb: str) -> Callable:
    """`_grouped_quantized`'s product for matmul backend mb, with `_with_batch_folded`'s vmap rule."""

    def blocks(rows, w, group_sizes):
        groups = w.data.shape[0] if isinstance(w, GGMLWeight) else w.shape[0]
        n = w.data.shape[1] if isinstance(w, GGMLWeight) else w.shape[2]
        block = _block_rows(rows.shape[0], groups)
        return _grouped_blocks(rows, group_sizes, groups, n, _group_product(w, rows.dtype, mb, block))

    return _with_batch_folded(blocks)


@_grouped_quantized.defjvp
def _grouped_quantized_jvp(mb, primals, tangents):
    rows, w, group_sizes = primals
    dense = w.dequantize() if isinstance(w, GGMLWeight) else w  # [E, K, N]
    tangent = _grouped_matmul_masked(tangents[0], dense.astype(rows.dtype), group_sizes)
    return _grouped_quantized(rows, w, group_sizes, mb), tangent


def _grouped_experts(rows, expert, group_sizes, lp: dict, cfg, mb: str = "xla") -> jax.Array:
    """Every expert's MLP on its rows, without the down-projection bias. rows: [R, hidden] sorted by expert;
    expert: [R] each row's expert; group_sizes: [experts] rows per expert; mb: the matmul backend. Returns
    [R, hidden] (partial sums over this device's slice of the intermediate axis when the weights are split)."""
    gu = expert_matmul(rows, _flat_experts(lp["experts_gate_up"]), group_sizes, expert, mb)  # [R, 2 * inter]
    gu = gu.reshape(gu.shape[0], 2, -1)  # [R, 2, inter]
    if "experts_gate_up_bias" in lp:
        gu = gu + lp["experts_gate_up_bias"].astype(gu.dtype)[expert]  # [R, 2, inter]
    h = expert_activation(gu[:, 0], gu[:, 1], cfg)  # [R, inter]
    return expert_matmul(h, _flat_experts(lp["experts_down"]), group_sizes, expert, mb)  # [R, hidden]


def _moe(x: jax.Array, lp: dict, cfg: ModelConfig, axis: str | None, mb: str = "xla") -> jax.Array:
    """moe_mlp on one device; `axis` names the mesh axis the intermediate dims are split over (None: unsplit)."""
    T, k = x.shape[0], cfg.num_experts_per_tok
    weights, experts = route(x, lp, cfg, mb)  # [T, k]
    flat = experts.reshape(-1)  # [T * k], row j = (token j // k, rank j % k)
    order = jnp.argsort(flat, stable=True)  # [T * k] sorted row -> (token, rank) row
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # [experts]
    y = _grouped_experts(x[order // k], flat[order], group_sizes, lp, cfg, mb)  # [T * k, hidden]
    # back to (token, rank) order by the inverse permutation, then each token's k outputs summed in rank order:
    # a gather and a fixed-order sum, so a token's result does not depend on the other tokens (no scatter-add race)
    y = y[_inverse_permutation(order)].reshape(T, k, -1).astype(jnp.float32)  # [T, k, hidden]
    out = _rank_sum(weights, y, mb)  # [T, hidden] float32
    if axis is not None:
        out = jax.lax.psum(out, axis)  # each device summed over its slice of the intermediate axis
    if "experts_down_bias" in lp:
        bias = lp["experts_down_bias"].astype(jnp.float32)[experts]  # [T, k, hidden]
        out = out + _rank_sum(weights, bias, mb)
    return out.astype(x.dtype)


def _rank_sum(weights: jax.Array, y: jax.Array, mb: str) -> jax.Array:
    """sum_j weights[:, j] * y[:, j]: weights [T, k], y [T, k, hidden] -> [T, hidden]; for a batch-invariant backend
    as k products added in rank order (each token's result its own), else one einsum."""
    if mb not in ROW_INVARIANT:
        return jnp.einsum("tk,tkh->th", weights, y)
    out = weights[:, 0, None] * y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + weights[:, j, None] * y[:, j]
    return out


def moe_mlp(
    x: jax.Array, lp: dict, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None, mb: str = "xla"
) -> jax.Array:
    """The mixture-of-experts MLP of one layer. x: [T, hidden] -> [T, hidden].

    Routes every token (`route`), sorts the T * k (token, expert) rows by expert, runs gate/up and down as two
    grouped matmuls (`grouped_matmul`; group sizes = rows per expert), applies the routing weights and sums each
    token's k rows. All shapes depend on T only, so a new routing never compiles anything.
    mesh: a tensor-parallel ("tp",) mesh: each device runs its slice of every expert's intermediate axis inside a
    shard_map (routing replicated) and the partial outputs are summed with one psum of [T, hidden].
    mb: the matmul backend ("cpu_rows": quantized experts' GGML blocks on the CPU kernel, see `expert_matmul`)."""
    moe = {key: lp[key] for key in MOE_KEYS if key in lp}
    if mesh is None or mesh.shape[TP] == 1:
        return _moe(x, moe, cfg, None, mb)
    specs = param_specs({"layers": [moe]}, cfg, mesh.shape[TP])["layers"][0]  # the weight map's split
    fn = jax.shard_map(
        functools.partial(_moe, cfg=cfg, axis=TP, mb=mb),
        mesh=mesh,
        in_specs=(P(), specs),
        out_specs=P(),
        check_vma=False,
    )
    return fn(x, moe)
