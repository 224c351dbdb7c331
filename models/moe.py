"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): each token is routed to its top-k experts, and the experts
run as grouped matmuls (`grouped_matmul`: a blocked loop on CPU, a Pallas kernel on CUDA) over the (token, expert)
rows sorted by expert, with static shapes.

Parameters of a MoE layer (see `models.transformer`): router [hidden, experts], optional router_bias [experts],
experts_gate_up [experts, hidden, 2, moe_intermediate], experts_down [experts, moe_intermediate, hidden], optional
experts_gate_up_bias [experts, 2, moe_intermediate] and experts_down_bias [experts, hidden].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from netra_jax.config import ModelConfig
from netra_jax.models.weight_map import TP, param_specs
from netra_jax.ops.grouped_matmul_triton import grouped_matmul_triton

MOE_KEYS = ("router", "router_bias", "experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")


def route(x: jax.Array, lp: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k routing in float32. x: [T, hidden]. Returns (weights [T, k] float32, experts [T, k] int32).

    The k largest router logits pick the experts (softmax is monotonic, so these are the k most probable ones);
    weights are their softmax probabilities over all experts, renormalised to sum to 1 when `cfg.norm_topk_prob`
    (Mixtral, gpt-oss, most Qwen3-MoE) — which is the softmax over the k chosen logits, computed as such."""
    logits = jnp.dot(x, lp["router"].astype(x.dtype), preferred_element_type=jnp.float32)  # [T, experts]
    if "router_bias" in lp:
        logits = logits + lp["router_bias"].astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)  # [T, k], largest first
    if cfg.norm_topk_prob:
        weights = jax.nn.softmax(top, axis=-1)
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


@jax.custom_vjp
def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [R, K] sorted by group, w [G, K, N], group_sizes [G] (summing to R) -> [R, N]: each row times its
    group's matrix. CPU and CUDA lower `jax.lax.ragged_dot` to one product of every row with every group's matrix,
    masked (G times the FLOPs and a [R, G, K] copy of the rows; a decode step reads every expert), so CPU runs
    `_grouped_matmul_blocks` (measured 3-15x faster for 8 experts of 1024 x 1024, from 512 to 2 rows) and CUDA the
    Pallas kernel `ops.grouped_matmul_triton` (a Qwen3-30B-A3B step of 2048 tokens: 8 GiB of temporaries less);
    other platforms keep ragged_dot.

    Reverse-mode differentiable in rows and w on every platform: the backward is ragged_dot's (the blocked loop's
    data-dependent trip counts and the kernel have none), so it costs the masked product of every row with every
    group."""
    return jax.lax.platform_dependent(
        rows, w, group_sizes, cpu=_grouped_matmul_blocks, cuda=grouped_matmul_triton, default=jax.lax.ragged_dot
    )


def _grouped_matmul_fwd(rows, w, group_sizes):
    return grouped_matmul(rows, w, group_sizes), (rows, w, group_sizes)


def _grouped_matmul_bwd(res, g):
    rows, w, group_sizes = res
    _, vjp = jax.vjp(lambda rows, w: jax.lax.ragged_dot(rows, w, group_sizes), rows, w)
    return (*vjp(g), None)  # the integer group sizes have no cotangent


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _block_rows(rows: int, groups: int) -> int:
    """Rows per block: a group's even share rounded up to a power of two, within [8, 64]."""
    share = -(-rows // groups)
    return min(64, max(8, 1 << (share - 1).bit_length()))


def _grouped_matmul_blocks(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul as a loop over groups and, inside, over blocks of the group's rows: each block is one
    [B, K] @ [K, N] dot with the group's matrix, so the work follows the rows each group has (a group without rows
    is skipped, its matrix not even read). Both loops are `fori_loop`s with data trip counts: the shapes stay
    static and the program's size does not grow with the number of groups (unrolled over 128 experts, one layer
    took 6 s to compile; as a loop 0.3 s, and it runs as fast)."""
    R, K = rows.shape
    G, _, N = w.shape
    B = _block_rows(R, G)
    starts = jnp.cumsum(group_sizes) - group_sizes  # [G] first row of each group
    padded = jnp.concatenate([rows, jnp.zeros((B, K), rows.dtype)])  # [R + B, K]: a block never reads past the end
    out = jnp.zeros((R + B, N), rows.dtype)

    def group(g, out):  # in group order: rows a block writes past its group's end belong to later groups
        def run(out):
            wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # [K, N], taken once for all the group's blocks

            def block(b, out):
                r = starts[g] + b * B
                y = jnp.dot(jax.lax.dynamic_slice_in_dim(padded, r, B), wg)  # [B, N]
                return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), r, 0)

            return jax.lax.fori_loop(0, (group_sizes[g] + B - 1) // B, block, out)

        return jax.lax.cond(group_sizes[g] > 0, run, lambda out: out, out)

    return jax.lax.fori_loop(0, G, group, out)[:R]


def _grouped_experts(rows: jax.Array, expert: jax.Array, group_sizes: jax.Array, lp: dict, cfg) -> jax.Array:
    """Every expert's MLP on its rows, without the down-projection bias. rows: [R, hidden] sorted by expert;
    expert: [R] each row's expert; group_sizes: [experts] rows per expert. Returns [R, hidden] (partial sums over
    this device's slice of the intermediate axis when the weights are split)."""
    w_gu = lp["experts_gate_up"]  # [experts, hidden, 2, inter]
    E, H, _, inter = w_gu.shape
    gu = grouped_matmul(rows, w_gu.reshape(E, H, 2 * inter).astype(rows.dtype), group_sizes)  # [R, 2 * inter]
    gu = gu.reshape(-1, 2, inter)
    if "experts_gate_up_bias" in lp:
        gu = gu + lp["experts_gate_up_bias"].astype(gu.dtype)[expert]  # [R, 2, inter]
    h = expert_activation(gu[:, 0], gu[:, 1], cfg)  # [R, inter]
    return grouped_matmul(h, lp["experts_down"].astype(h.dtype), group_sizes)  # [R, hidden]


def _moe(x: jax.Array, lp: dict, cfg: ModelConfig, axis: str | None) -> jax.Array:
    """moe_mlp on one device; `axis` names the mesh axis the intermediate dims are split over (None: unsplit)."""
    T, k = x.shape[0], cfg.num_experts_per_tok
    weights, experts = route(x, lp, cfg)  # [T, k]
    flat = experts.reshape(-1)  # [T * k], row j = (token j // k, rank j % k)
    order = jnp.argsort(flat, stable=True)  # [T * k] sorted row -> (token, rank) row
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # [experts]
    y = _grouped_experts(x[order // k], flat[order], group_sizes, lp, cfg)  # [T * k, hidden]
    # back to (token, rank) order by the inverse permutation, then each token's k outputs summed in rank order:
    # a gather and a fixed-order sum, so a token's result does not depend on the other tokens (no scatter-add race)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype))
    y = y[inverse].reshape(T, k, -1).astype(jnp.float32)  # [T, k, hidden]
    out = jnp.einsum("tk,tkh->th", weights, y)  # [T, hidden] float32
    if axis is not None:
        out = jax.lax.psum(out, axis)  # each device summed over its slice of the intermediate axis
    if "experts_down_bias" in lp:
        bias = lp["experts_down_bias"].astype(jnp.float32)[experts]  # [T, k, hidden]
        out = out + jnp.einsum("tk,tkh->th", weights, bias)
    return out.astype(x.dtype)


def moe_mlp(x: jax.Array, lp: dict, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """The mixture-of-experts MLP of one layer. x: [T, hidden] -> [T, hidden].

    Routes every token (`route`), sorts the T * k (token, expert) rows by expert, runs gate/up and down as two
    grouped matmuls (`grouped_matmul`; group sizes = rows per expert), applies the routing weights and sums each
    token's k rows. All shapes depend on T only, so a new routing never compiles anything.
    mesh: a tensor-parallel ("tp",) mesh: each device runs its slice of every expert's intermediate axis inside a
    shard_map (routing replicated) and the partial outputs are summed with one psum of [T, hidden]."""
    moe = {key: lp[key] for key in MOE_KEYS if key in lp}
    if mesh is None or mesh.shape[TP] == 1:
        return _moe(x, moe, cfg, None)
    specs = param_specs({"layers": [moe]}, cfg, mesh.shape[TP])["layers"][0]  # the weight map's split
    fn = jax.shard_map(
        functools.partial(_moe, cfg=cfg, axis=TP),
        mesh=mesh,
        in_specs=(P(), specs),
        out_specs=P(),
        check_vma=False,
    )
    return fn(x, moe)
