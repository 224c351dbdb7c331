"""Mosaic GPU ragged paged attention: interpreted on CPU (InterpretGPUParams) against the jnp reference and the float64
dense reference, lowered for an abstract H200 for every engine-relevant configuration, and end to end in a model."""

from __future__ import annotations

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import H200, SINKS, abstract_inputs, dense, make_case
from support.checkpoints import FIXTURES

from netra_jax.ops import cpu_kernels
from netra_jax.ops import paged_attention_mosaic as mosaic
from netra_jax.ops.attention import BACKENDS, AttentionMetadata, auto_backend, paged_attention_reference
from netra_jax.ops.paged_attention_mosaic import (
    MosaicConfig,
    choose_config,
    paged_attention_mosaic,
    paged_attention_mosaic_interpret,
    smem_bytes,
)

# prefill from scratch, decodes, chunked prefills with cached context, a single-token prompt, and a sequence with no
# new token this step (an empty query run)
MIXED = [(0, 21), (17, 1), (40, 1), (33, 12), (0, 1), (6, 0), (70, 3)]
DECODE = [(15, 1), (200, 1), (47, 1), (290, 1), (1, 1), (64, 1)]
TOL = 3e-2  # bf16 inputs and output; f32 softmax and accumulation


def check(seqs, *, window=None, cap=None, sinks=None, config=None, jnp_ref=False, dtype=jnp.bfloat16, **case):
    """The kernel (interpreted) against the float64 dense reference (and the jnp reference if jnp_ref: each costs a
    compilation, and the two references agree in test_attention_reference) on one random case."""
    q, k, v, md = make_case(seqs, dtype=dtype, **{"pad_tokens": 3, "pad_seqs": 2, **case})
    kw = dict(scale=case["D"] ** -0.5, sliding_window=window, soft_cap=cap)
    if sinks is not None:
        kw["sinks"] = jnp.asarray(sinks[: q.shape[1]])
    out = paged_attention_mosaic_interpret(q, k, v, md, config=config, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense(q, k, v, md, **kw), atol=TOL, rtol=TOL)
    if jnp_ref:
        ref = np.asarray(paged_attention_reference(q, k, v, md, **kw), np.float32)
        np.testing.assert_allclose(out, ref, atol=TOL, rtol=TOL)
    assert not out[int(md.query_start_loc[-1]) :].any(), "padding tokens must give zeros"


@pytest.mark.parametrize(
    "G,D,P,KH",
    [(1, 64, 16, 2), (2, 128, 32, 1), (4, 64, 64, 1), (8, 64, 16, 1)],
    ids=["mha", "gqa2_d128_p32", "gqa4_p64", "gqa8"],  # GQA 3 (rows 63 of 64): test_model_steps_match_reference
)
def test_mixed_batch(G, D, P, KH):
    check(MIXED, G=G, D=D, P=P, KH=KH, jnp_ref=G == 4)


@pytest.mark.parametrize(
    "window,cap,sinks",
    [(24, None, SINKS), (9, 2.0, SINKS)],
    ids=["window_sinks", "window_softcap_sinks"],
)
def test_window_softcap_sinks(window, cap, sinks):
    # (200, 3): three tokens whose window starts many pages into their sequence; (90, 20): a chunk crossing the window
    seqs = [(200, 3), (5, 1), (90, 20), (0, 30)]
    check(seqs, window=window, cap=cap, sinks=sinks, G=2, D=64, P=16, KH=2, pad_seqs=1)


def test_decode_split_k_with_sinks():
    cfg = choose_config(6, 6, 4, 1, 64, 32, 32768)  # six programs: the chooser splits long contexts
    assert cfg.num_splits > 1 and cfg.block_rows == 8
    cfg = MosaicConfig(tile=64, num_stages=2, num_splits=3, block_rows=8)  # these contexts are 1 to 5 tiles long
    check(DECODE, sinks=SINKS, G=4, D=64, P=32, KH=1, pad_tokens=0, pad_seqs=0, config=cfg)


def test_split_k_with_prefill_rows_window_and_empty_splits():
    # four splits of a window's few tiles: some splits of the short sequences get no tile at all; 16-row blocks (8
    # tokens x G = 2) leave 48 of the 64 query rows in shared memory unwritten (NaN in the interpreter), unstored
    check(
        MIXED, window=30, G=2, D=64, P=16, KH=1, config=MosaicConfig(tile=64, num_stages=2, num_splits=4, block_rows=16)
    )


def test_head_dim_256_page_128():
    """head_dim 256 takes 64-key tiles, so a 128-key page is fetched in two TMA slices; its configurations read P
    from registers on the GPU (they spill with P in shared memory), which the interpreter runs with P in shared
    memory (the same arithmetic)."""
    cfg = choose_config(4, 2, 4, 1, 256, 128, 256)
    assert cfg.tile == 64 and cfg.p_in_registers and not choose_config(4, 2, 4, 1, 128, 128, 256).p_in_registers
    check([(150, 1), (0, 3)], G=4, D=256, P=128, KH=1, pad_tokens=1, pad_seqs=0)


def test_invisible_slots_are_masked_fp16_one_stage():
    """Whole pages are fetched, so slots no query may see (past a sequence's length, before its window, unused pages)
    reach shared memory: filled with large finite values they must not show in any output. In fp16, through a
    one-stage pipeline (each call of the interpreter compiles the kernel: one call covers the three)."""
    seqs = [(40, 2), (5, 1), (0, 7)]
    clean, dirty = make_case(seqs, P=32, KH=1, G=2, D=64, dtype=jnp.float16, pad_tokens=2, garbage=3e4)
    q, k, v, md = clean
    cfg = MosaicConfig(tile=64, num_stages=1)
    got = paged_attention_mosaic_interpret(q, dirty[1], dirty[2], md, scale=0.125, sliding_window=12, config=cfg)
    assert got.dtype == jnp.float16
    want = dense(q, k, v, md, scale=0.125, sliding_window=12)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=TOL, rtol=TOL)


def test_rejects_what_it_cannot_run():
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125)
    with pytest.raises(ValueError, match="one dtype for both"):
        paged_attention_mosaic_interpret(q.astype(jnp.bfloat16), k, v, md, scale=0.125)
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=80, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim=80"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125)
    q, k, v, md = make_case([(3, 2)], P=24, KH=1, G=2, D=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size=24"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125)
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="shared memory"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125, config=MosaicConfig(128, 8))


def test_backend_registry_and_auto_choice():
    assert BACKENDS["mosaic"] is paged_attention_mosaic
    assert BACKENDS["mosaic_interpret"] is paged_attention_mosaic_interpret
    bf16 = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
    assert auto_backend("gpu", "9.0", **bf16) == "mosaic"
    assert auto_backend("gpu", "10.0", **bf16) == "triton"  # Blackwell has no wgmma
    assert auto_backend("gpu", "8.0", **bf16) == "triton"
    assert auto_backend("gpu", "9.0", **dict(bf16, dtype=jnp.float32, kv_dtype=jnp.float32)) == "triton"
    assert auto_backend("gpu", "9.0", **dict(bf16, kv_dtype=jnp.float32)) == "triton"  # a float32 cache
    assert auto_backend("gpu", "9.0", **dict(bf16, head_dim=80)) == "triton"  # SmolLM2-style heads
    assert auto_backend("cpu", None, **bf16) == ("cpu" if cpu_kernels.available() else "reference")


# ------------------------------------------------------------------ abstract H200 lowering


def lower_h200(f, *args) -> str:
    """Lower for an abstract H200; Mosaic GPU must not warn at all (unlike the deprecated Triton lowering)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.sharding.use_abstract_mesh(H200):
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (q_heads, kv_heads, head_dim, sliding window, soft-cap, sinks): GQA 1..8, head_dim 64..256, the served families
MODELS = {
    "mha-d64": (8, 8, 64, None, None, False),
    "smollm2": (9, 3, 64, None, None, False),
    "llama3-8b": (32, 8, 128, None, None, False),
    "gemma3-1b": (4, 1, 256, 512, None, False),
    "gemma2-softcap": (16, 8, 256, 4096, 50.0, False),
    "gpt-oss": (64, 8, 64, 128, None, True),
}
# (tokens, sequences): a batch-1 decode (split-K), a batch-256 decode, a mixed chunked-prefill step; 32k-token
# contexts, each page size in turn (the model's index shifts them, so every pair of page size and step is lowered)
STEPS = [(1, 1), (256, 256), (512, 64)]
PAGE_SIZES = (16, 32, 64, 128)


@pytest.mark.parametrize("model", list(MODELS))
def test_lowers_for_h200(model):
    H, KH, D, window, cap, sinks = MODELS[model]
    splits = set()
    for k, (T, S) in enumerate(STEPS):
        P = PAGE_SIZES[(list(MODELS).index(model) + k) % len(PAGE_SIZES)]
        max_pages = 32768 // P
        f = functools.partial(paged_attention_mosaic, scale=D**-0.5, sliding_window=window, soft_cap=cap)
        if sinks:
            f = functools.partial(f, sinks=jnp.zeros((H,), jnp.float32))
        txt = lower_h200(f, *abstract_inputs(T, S, H, KH, D, P, jnp.bfloat16, num_pages=4096, max_pages=max_pages))
        assert txt.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
        cfg = choose_config(T, S, H // KH, KH, D, P, max_pages * P)
        assert smem_bytes(cfg, D) <= 220 * 1024
        splits.add(cfg.num_splits > 1)
    assert splits == ({True, False} if D <= 128 else {False})


def test_p_in_registers_lowers_and_needs_a_gpu():
    """The register-P variant (a knob to measure on the device) lowers for sm90; the interpreter cannot run it."""
    cfg = MosaicConfig(tile=128, num_stages=2, p_in_registers=True)
    f = functools.partial(paged_attention_mosaic, scale=0.1, sliding_window=100, config=cfg)
    assert "mosaic_gpu_v2" in lower_h200(f, *abstract_inputs(512, 8, 32, 8, 128, 16, jnp.bfloat16))
    q, k, v, md = make_case([(3, 2)], P=16, KH=1, G=2, D=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="GPU only"):
        paged_attention_mosaic_interpret(q, k, v, md, scale=0.125, config=cfg)


def test_lowering_is_a_real_gate(monkeypatch):
    """Mosaic GPU lowers the kernel body at .lower() time (no GPU needed), so GPU-only rejections fail here: a wgmma
    whose accumulator has 32 rows (not 64 per warpgroup) is refused, the same kernel with 64 rows lowers."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def matmul_kernel(m):
        def body(a_ref, o_ref, a_smem, bar):
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)
            plgpu.barrier_wait(bar)

            def mm(acc):
                plgpu.wgmma(acc, a_smem, a_smem.transpose((1, 0)))
                return acc[...]

            o_ref[...] = pl.run_scoped(mm, plgpu.ACC((m, m), jnp.float32))

        tx = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((m, m), jnp.float32),
            scratch_types=[plgpu.SMEM((m, 64), jnp.bfloat16, transforms=tx), plgpu.Barrier()],
        )

    txt = lower_h200(matmul_kernel(64), jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))
    assert txt.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
    with pytest.raises(Exception, match="first dimension must be a multiple of 64"):
        lower_h200(matmul_kernel(32), jax.ShapeDtypeStruct((32, 64), jnp.bfloat16))
    # shared memory is checked against sm90's 227 KiB at lowering too (past this module's own, smaller budget)
    monkeypatch.setattr(mosaic, "_SMEM_BUDGET", 1 << 30)
    f = functools.partial(paged_attention_mosaic, scale=0.1, config=MosaicConfig(128, 4))
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_h200(f, *abstract_inputs(8, 8, 32, 8, 128, 16, jnp.bfloat16))


# ------------------------------------------------------------------ end to end


def test_model_steps_match_reference():
    """A Gemma-3-shaped layer (sliding window 16, GQA 3) with head_dim 64 in bf16: a prefill chunk over 21
    cached tokens (past the 16-token window) through attention(backend="mosaic_interpret") gives the reference
    backend's logits."""
    from netra_jax.config import ModelConfig
    from netra_jax.loader import dummy
    from netra_jax.models.transformer import forward, init_kv_cache

    hf = json.loads((FIXTURES / "tiny-gemma3" / "config.json").read_text())
    layers = dict(num_hidden_layers=1, layer_types=["sliding_attention"])
    cfg = ModelConfig.from_hf_dict(dict(hf, head_dim=64, query_pre_attn_scalar=64, num_attention_heads=3, **layers))
    rng = np.random.default_rng(3)  # weights of std 0.15: scores of order one, far from uniform attention
    params = jax.tree.map(
        lambda s: jnp.asarray(0.15 * rng.standard_normal(s.shape), jnp.bfloat16), dummy.param_layout(cfg, np.float32)
    )
    P = 16
    bt = jnp.asarray([[4, 0, 5, 2, 1, 3]], jnp.int32)  # scattered pages
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, 40), jnp.int32)

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def step(kv, start, n, backend):
        slots = bt[0, jnp.arange(start, start + n) // P] * P + jnp.arange(start, start + n) % P
        md = AttentionMetadata(
            slot_mapping=slots.astype(jnp.int32),
            query_start_loc=jnp.array([0, n], jnp.int32),
            seq_lens=jnp.array([start + n], jnp.int32),
            block_tables=bt,
        )
        pos = jnp.arange(start, start + n, dtype=jnp.int32)
        return forward(params, cfg, ids[start : start + n], pos, kv, md, backend=backend)

    kv = init_kv_cache(cfg, bt.shape[1], P, jnp.bfloat16)
    kv = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), kv)  # 21 cached tokens (and more)
    want = np.asarray(step(kv, 21, 19, "reference")[0], np.float32)
    got = np.asarray(step(kv, 21, 19, "mosaic_interpret")[0], np.float32)
    np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max(), rtol=0)
