"""Pallas ragged paged attention and KV-write kernels: interpreted on CPU against the jnp reference, lowered for an
abstract H200 for every engine configuration, and end to end through the tiny Llama fixture (the GPU check's dry run:
tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from support.attention_cases import DECODE, MIXED, abstract_inputs, lower_h200, make_case
from support.checkpoints import FIXTURES

from benchmarks.kv_write_triton import write_kv_triton  # the GPU check's comparison kernel, not the runtime's
from netra_jax.ops import cpu_kernels
from netra_jax.ops.attention import BACKENDS, AttentionMetadata, attention, paged_attention_reference, write_kv
from netra_jax.ops.paged_attention_triton import KernelConfig, choose_config, paged_attention_triton

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def check(
    seqs, *, dtype=jnp.float32, window=None, cap=None, sinks=None, config=None, pad_tokens=3, pad_seqs=2, **shape
):
    q, k, v, md = make_case(seqs, dtype=dtype, pad_tokens=pad_tokens, pad_seqs=pad_seqs, **shape)
    kw = dict(scale=shape["D"] ** -0.5, sliding_window=window, soft_cap=cap, sinks=sinks)
    ref = paged_attention_reference(q, k, v, md, **kw)
    out = paged_attention_triton(q, k, v, md, interpret=True, config=config, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    n = int(md.query_start_loc[-1])
    assert not out[n:].any(), "padding tokens must give zeros"
    return out


@pytest.mark.parametrize(
    "G,D,P,KH",
    [(1, 64, 16, 4), (2, 128, 32, 2), (4, 64, 32, 2), (8, 128, 16, 1)],
    ids=["mha", "gqa2", "gqa4", "mqa8"],
)
def test_mixed_batch_f32(G, D, P, KH):
    check(MIXED, G=G, D=D, P=P, KH=KH)


@pytest.mark.parametrize(
    "window,cap",
    [(24, None), (9, 2.0)],
    ids=["window", "window_softcap"],
)
def test_window_and_softcap_f32(window, cap):
    check(MIXED, window=window, cap=cap, G=4, D=64, P=16, KH=2)


def test_decode_only_uses_split_k():
    q, _, _, md = make_case(DECODE, P=16, KH=2, G=4, D=64, dtype=jnp.float32)
    cfg = choose_config(q.shape[0], md.seq_lens.shape[0], 4, 2, 64, 16, md.block_tables.shape[1] * 16, 4)
    assert cfg.num_splits > 1 and cfg.block_m == 16
    check(DECODE, G=4, D=64, P=16, KH=2, pad_tokens=0, pad_seqs=0)


def test_split_k_with_prefill_rows_and_window():
    cfg = KernelConfig(block_m=32, tile=16, num_splits=4)
    check(MIXED, window=30, G=2, D=64, P=16, KH=2, config=cfg)


def test_sinks_single_pass_and_split_k():
    """Attention sinks (one extra softmax column per head) against the float64 dense reference, in the single-pass
    kernel and under split-K, where exactly one partial may count the sink."""
    from support.attention_cases import SINKS, dense

    sinks = jnp.asarray(SINKS[:4])
    for seqs, cfg in ((MIXED, None), (DECODE, KernelConfig(block_m=16, tile=16, num_splits=4))):
        out = check(seqs, sinks=sinks, window=50, G=2, D=64, P=16, KH=2, config=cfg, pad_tokens=2, pad_seqs=1)
        q, k, v, md = make_case(seqs, dtype=jnp.float32, pad_tokens=2, pad_seqs=1, P=16, KH=2, G=2, D=64)
        want = dense(q, k, v, md, scale=0.125, sliding_window=50, sinks=SINKS[:4])
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_bad_sinks_shape_is_refused():
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=16, dtype=jnp.float32)
    for backend in ("reference", "triton_interpret"):
        with pytest.raises(ValueError, match="sinks must have shape"):
            attention(q, k, v, md, scale=0.25, sinks=jnp.zeros(3), backend=backend)


def test_tile_smaller_than_page():
    check(MIXED, G=2, D=64, P=64, KH=2, config=KernelConfig(block_m=16, tile=32, num_splits=2))


def test_odd_group_and_head_dim():
    check(MIXED, G=3, D=80, P=16, KH=3)  # SmolLM2-style group of 3, head_dim padded to 128 inside


def test_bf16_mixed():
    check(MIXED, dtype=jnp.bfloat16, G=4, D=128, P=16, KH=2)


def test_bf16_decode_window_softcap():
    check(DECODE, dtype=jnp.bfloat16, window=40, cap=30.0, G=8, D=64, P=32, KH=1, pad_tokens=0)


def test_invisible_slots_are_never_read():
    """NaN in every slot past a sequence's length or on unused pages must not reach any output."""
    clean, dirty = make_case(MIXED, P=16, KH=2, G=2, D=64, dtype=jnp.float32, pad_tokens=2, garbage=np.nan)
    q, k, v, md = clean
    ref = paged_attention_reference(q, k, v, md, scale=0.125)
    cfg = KernelConfig(block_m=16, tile=32, num_splits=4)  # split-K: also checks the merge of empty partials
    out = paged_attention_triton(q, dirty[1], dirty[2], md, scale=0.125, interpret=True, config=cfg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_backend_registry():
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=16, dtype=jnp.float32)
    assert {"reference", "triton", "triton_interpret", "auto"} <= set(BACKENDS)
    assert BACKENDS["triton"] is paged_attention_triton
    a = attention(q, k, v, md, scale=0.25, backend="auto")  # on CPU: "cpu" (the reference with its C++ token rows)
    on_cpu = "cpu" if cpu_kernels.available() else "reference"
    np.testing.assert_array_equal(np.asarray(a), np.asarray(attention(q, k, v, md, scale=0.25, backend=on_cpu)))
    b = attention(q, k, v, md, scale=0.25, backend="reference")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(q, k, v, md, scale=0.25, config=KernelConfig(block_m=24, tile=16), interpret=True)


# ------------------------------------------------------------------ KV write


def test_kv_write_matches_scatter_and_is_in_place():
    rng = np.random.default_rng(1)
    N, P, KH, D, T = 6, 16, 2, 64, 21
    kp = jnp.asarray(rng.standard_normal((N, P, KH, D)), jnp.float32)
    vp = kp + 1
    k = jnp.asarray(rng.standard_normal((T, KH, D)), jnp.float32)
    v = k * 2
    slot = np.concatenate([rng.permutation(N * P)[: T - 3], [N * P, N * P + 7, 10**6]]).astype(np.int32)
    want = write_kv(kp, vp, k, v, jnp.asarray(slot))
    f = jax.jit(functools.partial(write_kv_triton, interpret=True), donate_argnums=(0, 1))
    kp2, vp2 = kp + 0, vp + 0
    ptrs = (kp2.unsafe_buffer_pointer(), vp2.unsafe_buffer_pointer())
    got = f(kp2, vp2, k, v, jnp.asarray(slot))
    assert (got[0].unsafe_buffer_pointer(), got[1].unsafe_buffer_pointer()) == ptrs
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the XLA scatter the model uses today is also in place under donation
    g = jax.jit(write_kv, donate_argnums=(0, 1))
    kp3 = kp + 0
    ptr = kp3.unsafe_buffer_pointer()
    assert g(kp3, vp + 0, k, v, jnp.asarray(slot))[0].unsafe_buffer_pointer() == ptr


# ------------------------------------------------------------------ abstract H200 lowering


# (q_heads, kv_heads, head_dim, sliding window, soft-cap) of the served families and fixtures
MODELS = {
    "tiny-llama": (4, 2, 16, None, None),
    "tiny-qwen2": (4, 1, 16, None, None),
    "tiny-gemma3": (4, 1, 32, 16, None),
    "smollm2": (9, 3, 64, None, None),
    "llama3-8b": (32, 8, 128, None, None),
    "qwen3-8b": (32, 8, 128, None, None),
    "gemma3-1b": (4, 1, 256, 512, None),
    "gemma3-27b": (32, 16, 128, 1024, None),
    "softcap": (16, 8, 256, 4096, 50.0),
}
# (tokens, sequences, page size, dtype): decode buckets (split-K and not), chunked-prefill steps, each page size,
# and float32 (the CPU default, also servable on GPU) for both kernel shapes
STEPS = [
    (1, 1, 16, jnp.bfloat16),
    (256, 256, 32, jnp.bfloat16),
    (2048, 16, 64, jnp.bfloat16),
    (8, 8, 64, jnp.float32),
    (1024, 8, 16, jnp.float32),
]


@pytest.mark.parametrize("model", list(MODELS))
def test_lowers_for_h200(model):
    H, KH, D, window, cap = MODELS[model]
    configs = set()
    for T, S, P, dtype in STEPS:
        f = functools.partial(paged_attention_triton, scale=D**-0.5, sliding_window=window, soft_cap=cap)
        args = abstract_inputs(T, S, H, KH, D, P, dtype)
        txt = lower_h200(f, *args)
        assert txt.count("__gpu$xla.gpu.triton") == 1
        configs.add(choose_config(T, S, H // KH, KH, D, P, 256 * P, jnp.dtype(dtype).itemsize))
    assert len({c.num_splits > 1 for c in configs}) == 2, "both the split-K and the single-pass kernel are lowered"
    kv = jax.ShapeDtypeStruct((2048, 16, KH, D), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((256, KH, D), jnp.bfloat16)
    txt = lower_h200(write_kv_triton, kv, kv, new, new, jax.ShapeDtypeStruct((256,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1


def test_lowering_check_rejects_non_power_of_two_blocks():
    """The abstract-H200 lowering is a real gate: a kernel loading a 24-wide block must fail it."""

    def bad(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, 24)] * 2

    def f(x):
        return pl.pallas_call(
            bad, out_shape=jax.ShapeDtypeStruct((24,), x.dtype), compiler_params=plgpu.CompilerParams()
        )(x)

    with pytest.raises(ValueError, match="power of 2"):
        lower_h200(f, jax.ShapeDtypeStruct((32,), jnp.float32))


# ------------------------------------------------------------------ end to end


def test_tiny_llama_forward_matches_reference_and_fixture():
    from netra_jax.config import ModelConfig
    from netra_jax.loader.hf import HFCheckpoint
    from netra_jax.models.transformer import forward, init_kv_cache
    from netra_jax.models.weight_map import hf_to_params

    d = FIXTURES / "tiny-llama"
    cfg = ModelConfig.from_hf_dir(d)
    ck = HFCheckpoint(d)
    params = jax.tree.map(jnp.asarray, hf_to_params(cfg, ck.get, ck.has, np.float32))
    case = json.loads((d / "reference.json").read_text())["cases"][0]
    ids = case["prompt_ids"]
    T, P = len(ids), 16
    n_pages = (T + 24) // P + 2
    bt = jnp.arange(n_pages, dtype=jnp.int32)[None]
    fwd = jax.jit(forward, static_argnames=("cfg", "backend"))

    def md_for(start, n):
        return AttentionMetadata(
            slot_mapping=jnp.arange(start, start + n, dtype=jnp.int32),
            query_start_loc=jnp.array([0, n], jnp.int32),
            seq_lens=jnp.array([start + n], jnp.int32),
            block_tables=bt,
        )

    pos = jnp.arange(T, dtype=jnp.int32)
    logits_ref, _ = fwd(params, cfg, jnp.array(ids), pos, init_kv_cache(cfg, n_pages, P), md_for(0, T))
    logits, kv = fwd(
        params, cfg, jnp.array(ids), pos, init_kv_cache(cfg, n_pages, P), md_for(0, T), backend="triton_interpret"
    )
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.array(case["logits"]), atol=1e-4, rtol=1e-4)
    out = [int(jnp.argmax(logits[-1]))]
    for t in range(T, T + len(case["greedy_ids"]) - 1):
        lg, kv = fwd(params, cfg, jnp.array([out[-1]]), jnp.array([t]), kv, md_for(t, 1), backend="triton_interpret")
        out.append(int(jnp.argmax(lg[-1])))
    assert out == case["greedy_ids"]
