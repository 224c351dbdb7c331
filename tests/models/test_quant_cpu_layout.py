"""Grouped integer weights (AWQ, GPTQ, compressed-tensors pack-quantized) re-laid as GGML blocks for the CPU kernels
(`quant.repack.for_cpu`): the blocks hold the stored integers and scales (Q4_0 exactly, Q4_1 within the fp16 rounding
of its min), act-order weights read x in their stored row order, weights the blocks cannot hold keep the jnp
reference, and the fixtures the formats' libraries packed give transformers' logits through both CPU backends
(within the rounding they skip or add) and its greedy tokens served on float activations."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_quantized import FIXTURES, reference, write_random_gptq

from netra_jax import LLM, SamplingParams
from netra_jax.loader import load_model
from netra_jax.models.transformer import forward_dense
from netra_jax.quant import GGMLWeight, PackedIntWeight, PermutedWeight, leaf_layout, matmul, weight_layout
from netra_jax.quant.repack import for_cpu, ggml_from_packed, pack_along_k

# fixture -> the GGML type its 4-bit weights become (symmetric: Q4_0; zero points: Q4_1)
PACKED = {"ct_w4a16": "Q4_0", "ct_w4a16_asym": "Q4_1", "awq": "Q4_1", "gptq": "Q4_1"}


def exact(w: PackedIntWeight) -> tuple[np.ndarray, np.ndarray]:
    """(q - zero) * scale in float64, unrounded [K, N], and |zero * scale| [K, N] (0 when symmetric)."""
    g = np.asarray(w.groups())
    q = np.asarray(w.values()).astype(np.float64)
    zero = np.full_like(q, 1 << (w.bits - 1)) if w.zero is None else np.asarray(w.zero)[g].astype(np.float64)
    scale = np.asarray(w.scale).astype(np.float64)[g]
    return (q - zero) * scale, np.abs(zero * scale) * (w.zero is not None)


def packed_weights(fmt: str) -> list[tuple[str, PackedIntWeight]]:
    _, params = load_model(FIXTURES / fmt, dtype="float32", cache=False)
    lp = params["layers"][0]
    return [(name, w) for name, w in lp.items() if isinstance(w, PackedIntWeight)]


@pytest.mark.parametrize("fmt", list(PACKED))
def test_fixture_weights_become_the_blocks_holding_their_values(fmt):
    """Q4_0: d * (q - 8) with d the stored fp16 scale, exact in float32. Q4_1: d * q + m with m = -zero * d rounded
    once to fp16 (half an fp16 ulp of |zero * d|). GPTQ's act-order weights: their rows sorted by group, read back in
    their own order by `dequantize`."""
    weights = packed_weights(fmt)
    assert len(weights) >= 5
    for name, w in weights:
        g = ggml_from_packed(w)
        assert isinstance(g, PermutedWeight) == (w.g_idx is not None), name
        stored = g.stored if isinstance(g, PermutedWeight) else g
        assert isinstance(stored, GGMLWeight) and stored.qtype == PACKED[fmt], name
        assert g.shape == w.shape
        want, zd = exact(w)
        got = np.asarray(g.dequantize()).reshape(want.shape)
        bound = 2.0**-11 * zd + 2.0**-23 * (np.abs(want) + zd)
        assert np.all(np.abs(got - want) <= bound), (fmt, name, np.abs(got - want).max())
    assert fmt != "gptq" or any(w.g_idx is not None for _, w in weights)  # the fixture has act-order


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_kernels_read_the_re_laid_weights(fmt, rows):
    """x @ w through each CPU backend on the re-laid weight, against float64 x @ its de-quantized values: float
    activations to float32 rounding, int8 activations to their rounding (1/127 of a block's largest x); the
    einsum form of gate and up too."""
    rng = np.random.default_rng(rows)
    for name, w in packed_weights(fmt):
        g = ggml_from_packed(w)
        spec = "th,hki->tki" if name == "w_gate_up" else None
        x = rng.standard_normal((rows, w.shape[0])).astype(np.float32)
        want = np.einsum(spec or "tk,kn->tn", x.astype(np.float64), np.asarray(g.dequantize(), np.float64))
        scale = np.abs(x).sum(-1).max() * np.abs(np.asarray(g.dequantize())).max()  # bound of any output
        for backend, tol in (("cpu_rows", 1e-6), ("cpu_rows_q8", 1 / 127)):
            y = np.asarray(matmul(jnp.asarray(x), g, spec, backend=backend))
            assert y.shape == want.shape
            assert np.abs(y - want).max() <= tol * scale, (fmt, name, backend)


def _weight(rng, k: int, n: int, bits: int, group: int, zero=True, scale_dtype=np.float16) -> PackedIntWeight:
    q = rng.integers(0, 1 << bits, (k, n))
    z = rng.integers(0, 1 << bits, (k // group, n)).astype(np.int32) if zero else None
    s = rng.uniform(1e-3, 1e-2, (k // group, n)).astype(scale_dtype)
    packed = np.asarray(pack_along_k(jnp.asarray(q), bits))
    return PackedIntWeight(packed, s, z, None, bits=bits, group=group, shape=(k, n))


def test_symmetric_weights_become_q4_0_and_q8_0_exactly():
    rng = np.random.default_rng(0)
    for bits, qtype in ((4, "Q4_0"), (8, "Q8_0")):
        w = _weight(rng, 128, 40, bits, 64, zero=False)
        g = ggml_from_packed(w)
        assert isinstance(g, GGMLWeight) and g.qtype == qtype
        np.testing.assert_array_equal(np.asarray(g.dequantize()), exact(w)[0].astype(np.float32))
    w = _weight(rng, 64, 8, 4, 32)  # zero points all 8: symmetric too
    w = w.replace(zero=np.full_like(w.zero, 8))
    assert ggml_from_packed(w).qtype == "Q4_0"


def test_weights_the_blocks_cannot_hold_keep_the_reference():
    """8 bits with zero points (no such GGML block), a group of 16 (a block spans two), float32 scales fp16 would
    round, and an act-order g_idx whose groups are not whole blocks: `for_cpu` leaves them PackedIntWeight."""
    rng = np.random.default_rng(1)
    odd_scales = _weight(rng, 64, 8, 4, 32, scale_dtype=np.float32)
    odd_scales = odd_scales.replace(scale=odd_scales.scale + np.float32(1e-9))
    ragged = _weight(rng, 64, 8, 4, 32)
    ragged = ragged.replace(g_idx=np.r_[np.zeros(30), np.ones(34)].astype(np.int32))  # groups of 30 and 34 rows
    cannot = [_weight(rng, 64, 8, 8, 32), _weight(rng, 64, 8, 4, 16), odd_scales, ragged]
    for w in cannot:
        assert ggml_from_packed(w) is None
    params = {"layers": [{"wq": w} for w in cannot]}
    assert all(isinstance(lp["wq"], PackedIntWeight) for lp in for_cpu(params)["layers"])


# backend -> logit tolerance relative to the largest logit: float activations, the library's own rounding of each
# weight to its scale dtype (which the blocks' exact float32 products skip), a few units of that dtype's roundoff;
# int8 activations add their rounding (half of 1/127 of a block's largest x).
LOGIT_TOLERANCE = {"cpu_rows": lambda u: 4 * u, "cpu_rows_q8": lambda u: 2.5e-2}


@pytest.mark.parametrize("backend", list(LOGIT_TOLERANCE))
@pytest.mark.parametrize("fmt", list(PACKED))
def test_logits_through_the_cpu_kernels_match_transformers(fmt, backend):
    ref = reference(fmt)
    cfg, params = load_model(FIXTURES / fmt, dtype="float32", cache=False)
    scale_dtype = params["layers"][0]["w_down"].scale.dtype
    relaid = weight_layout(params, backend)
    assert isinstance(relaid["layers"][0]["w_down"], GGMLWeight | PermutedWeight)
    logits = forward_dense(relaid, cfg, jnp.asarray(ref["prompt_ids"]), matmul_backend=backend)  # [prompt, vocab]
    tol = LOGIT_TOLERANCE[backend](float(jnp.finfo(scale_dtype).eps) / 2) * np.abs(ref["logits"]).max()
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=0, atol=tol)


@pytest.mark.parametrize("fmt", list(PACKED))
def test_served_greedy_tokens_through_the_cpu_kernels(fmt):
    ref = reference(fmt)
    llm = LLM(str(FIXTURES / fmt), dtype="float32", max_model_len=64, warmup=False, matmul_backend="cpu_rows")
    lp = llm.params["layers"][0]
    qkv = ("wqkv",) if "wqkv" in lp else ("wq", "wk", "wv")  # joined where the three are blocks of one type
    assert all(isinstance(lp[k], GGMLWeight | PermutedWeight) for k in (*qkv, "wo", "w_gate_up"))
    out = llm.generate(
        [{"prompt_token_ids": ref["prompt_ids"].tolist()}],
        SamplingParams(max_tokens=len(ref["greedy_ids"]), temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert list(out[0].outputs[0].token_ids) == ref["greedy_ids"].tolist()


def test_the_loader_re_lays_each_weight_as_it_is_placed(tmp_path):
    """`load_model(layout=)` re-lays each parameter as soon as it is placed, so the stored and the re-laid forms of
    the model are never held together: at every call the live device bytes stay within the final model's plus one
    stored weight (re-laying the whole tree after the load holds both: about twice the model)."""
    d = write_random_gptq(tmp_path / "gptq")
    cpu_layout = leaf_layout("cpu_rows")
    live: list[int] = []
    largest = 0
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())  # what earlier tests of the process still hold

    def layout(w):
        nonlocal largest
        largest = max(largest, sum(a.nbytes for a in jax.tree.leaves(w)))
        out = cpu_layout(w)
        live.append(sum(a.nbytes for a in jax.live_arrays()) - before)
        return out

    _, params = load_model(d, cache=False, layout=layout)
    weights = [w for lp in params["layers"] for w in lp.values() if not isinstance(w, jax.Array)]
    assert len(weights) >= 4 * 5 and all(isinstance(w, GGMLWeight) and w.qtype == "Q4_1" for w in weights)
    held = sum(a.nbytes for a in jax.tree.leaves(params))
    assert max(live) <= held + largest, (max(live), held, largest)
    assert held >= 0.9 * (d / "model.safetensors").stat().st_size  # the blocks hold the model (here 1.2x the file)
