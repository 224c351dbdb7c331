"""benchmarks/random_gguf.py: the random-weight Llama GGUF it writes is the model it says (shape, types, parameter
count, tokenizer of its source file), its weights are the seeded normal draws within the format's rounding, and the
loader and engine read it like a downloaded file."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from benchmarks import random_gguf
from netra_jax import loader
from netra_jax.loader.gguf_loader import GGUFFile, read_gguf_metadata
from netra_jax.quant import GGMLWeight

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("random_gguf") / "tiny-q8_0.gguf"
    info = random_gguf.write(out, "q8_0", tokenizer_from=smollm2_path, seed=3, **SHAPE)
    return out, info


def test_file_is_the_model_it_describes(tiny, smollm2_path):
    path, info = tiny
    cfg = loader.load_config(path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        2,
        64,
        4,
        2,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.head_dim) == (128, 49152, True, 16)
    tensors = GGUFFile(path).tensors
    assert {n: t.qtype.name for n, t in tensors.items() if n.endswith("norm.weight")} == {
        "output_norm.weight": "F32",
        **{f"blk.{i}.{k}.weight": "F32" for i in range(2) for k in ("attn_norm", "ffn_norm")},
    }
    matrices = {t.qtype.name for n, t in tensors.items() if not n.endswith("norm.weight")}
    assert matrices == {"Q8_0"} and "output.weight" not in tensors  # tied embeddings
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert info["parameters"] == 49152 * 64 + 64 + 2 * per_layer == sum(int(np.prod(t.shape)) for t in tensors.values())
    assert info["bytes"] == path.stat().st_size
    mine, source = read_gguf_metadata(path), read_gguf_metadata(smollm2_path)
    tokenizer_keys = {k for k in source if k.startswith("tokenizer.")}
    assert tokenizer_keys and {k: mine[k] for k in tokenizer_keys} == {k: source[k] for k in tokenizer_keys}
    assert mine["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)


def test_weights_are_the_seeded_draws_within_q8_0_rounding(tiny):
    """The loader's float32 embedding and down projection against the generator's draws (same seed, same order):
    Q8_0 keeps each value within half its block's step d = max|x| / 127, plus what storing d as float16 adds
    (127 x d x 2^-11 at most): 0.57 d."""
    path, _ = tiny
    _, params = loader.load_model(path, "float32", cache=False)  # the weights kept in Q8_0: compared de-quantized
    params = jax.tree.map(
        lambda w: w.dequantize() if isinstance(w, GGMLWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, GGMLWeight),
    )
    rng = np.random.default_rng(3)
    embed = rng.standard_normal((49152, 64), dtype=np.float32) * np.float32(0.02)
    step = np.abs(embed.reshape(49152, 2, 32)).max(-1, keepdims=True) / 127
    err = np.abs(np.asarray(params["embed"]).reshape(49152, 2, 32) - embed.reshape(49152, 2, 32))
    assert (err <= 0.57 * step).all() and err.max() > 0
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(params["embed"]).T)
    shapes = random_gguf.matrix_shapes(**{k: SHAPE[k] for k in ("hidden", "heads", "kv_heads", "ffn")})
    for name in random_gguf.LAYER_MATRICES:  # layer 0's draws, in the file's order; ffn_down is the last
        last = rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(0.02)
    down = np.asarray(params["layers"][0]["w_down"]).T  # [hidden, ffn], as the file holds it
    assert np.abs(down - last).max() <= 0.57 * np.abs(last).max() / 127


def test_engine_generates_from_it(tiny):
    from netra_jax import LLM, SamplingParams

    path, _ = tiny
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2, num_kv_pages=16, warmup=False)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("encode, qtype", [("quantize_q4_k", "Q4_K"), ("quantize_q6_k", "Q6_K")])
def test_k_quant_blocks_decode_to_the_values_within_their_step(encode, qtype):
    """The K-quant encoders' bytes, read by gguf.quants' de-quantization (ggml's layout, written by others): each
    value within half a sub-block's step of the draw, plus the rounding of the 6-bit (Q4_K) or 8-bit (Q6_K) scales
    (at most half a scale unit, i.e. 1/63 resp. 1/127 of the block's largest scale over the 15 resp. 31 steps)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 512), dtype=np.float32) * np.float32(0.02)
    w[0, :32] *= 20  # an outlier sub-block: the others' scales are small against the block's largest
    blocks = getattr(random_gguf, encode)(w)
    t = gguf.GGMLQuantizationType[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 512 // 256 * gguf.GGML_QUANT_SIZES[t][1])
    got = gguf.quants.dequantize(blocks, t)
    if qtype == "Q4_K":  # step (max - min) / 15 per 32 values; a value may also lose half the block's scale units
        sub = w.reshape(6, 2, 8, 32)
        span = sub.max(-1) - np.minimum(sub.min(-1), 0)
        bound = span / 30 + 16 * span.max(-1, keepdims=True) / 63 / 2 + np.abs(sub).max(-1) / 63
    else:  # step max|x| / 31 per 16 values
        sub = w.reshape(6, 2, 16, 16)
        amax = np.abs(sub).max(-1)
        bound = amax / 62 + 32 * amax.max(-1, keepdims=True) / 31 / 127 / 2
    err = np.abs(got.reshape(sub.shape) - sub).max(-1)
    assert (err <= bound * 1.01 + 1e-7).all(), (err / bound).max()
    assert np.corrcoef(got.ravel(), w.ravel())[0, 1] > 0.99


def test_q4_k_m_file_is_llama_quantize_s_mix(tmp_path, smollm2_path):
    """--type q4_k_m: Q4_K everywhere, Q6_K for attn_v / ffn_down of the layers llama-quantize gives more bits (8
    layers: 0, 3, 6 and 7) and for the output matrix; an untied model with a padded vocabulary; the engine reads it."""
    shape = {"hidden": 256, "layers": 8, "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 49160, "tied": False}
    path = tmp_path / "tiny-q4_k_m.gguf"
    random_gguf.write(path, "q4_k_m", tokenizer_from=smollm2_path, **shape)
    types = {n: t.qtype.name for n, t in GGUFFile(path).tensors.items() if not n.endswith("norm.weight")}
    more = {0, 3, 6, 7}
    assert [i for i in range(8) if random_gguf.use_more_bits(i, 8)] == sorted(more)
    expected = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
    for i in range(8):
        for m in random_gguf.LAYER_MATRICES:
            expected[f"blk.{i}.{m}.weight"] = "Q6_K" if m in ("attn_v", "ffn_down") and i in more else "Q4_K"
    assert types == expected
    meta = read_gguf_metadata(path)
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 49160 and tokens[-1] == "<|reserved_special_token_7|>"
    assert meta["tokenizer.ggml.token_type"][-8:] == [int(gguf.TokenType.CONTROL)] * 8
    cfg = loader.load_config(path)
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (49160, False)

    from netra_jax import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2, num_kv_pages=16, warmup=False)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"type_name": "q4_k"}, "'q4_k' is not one this writes"),
        ({"type_name": "q4_k_m", "hidden": 128, "ffn": 256}, "blocks of 256"),
        ({"vocab": 100}, "smaller than the tokenizer's 49152 tokens"),
        ({"hidden": 64, "heads": 6}, "heads must divide"),
        ({"type_name": "q4_0", "hidden": 48, "heads": 4, "kv_heads": 2}, "blocks of 32"),
    ],
)
def test_bad_shapes_and_types_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        random_gguf.write(tmp_path / "x.gguf", **kwargs)
    assert not list(tmp_path.iterdir())
