"""A GGUF model mixing quantization types the way llama.cpp's Q4_K_M / Q5_K_M files do (Q4_K, Q5_K and Q6_K tensors,
F32 norms) loads through `load_model` to the same parameters as the float model its blocks encode by definition:
its weights and embedding kept in their blocks (`GGMLWeight`, each of its tensor's type), de-quantizing to exactly
the float model's values."""

from __future__ import annotations

import jax
import numpy as np
from gguf import GGMLQuantizationType as Q
from support.gguf_blocks import enc_q4_k, enc_q5_k, enc_q6_k, write_gguf

from netra_jax.loader import load_model
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.quant import GGMLWeight

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 64, 2
HEAD_DIM = HIDDEN // HEADS
META = {
    "llama.context_length": 512,
    "llama.embedding_length": HIDDEN,
    "llama.block_count": LAYERS,
    "llama.feed_forward_length": FFN,
    "llama.attention.head_count": HEADS,
    "llama.attention.head_count_kv": KV_HEADS,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0,
    "tokenizer.ggml.eos_token_id": 2,
}
# llama.cpp tensor -> (numpy shape, type per layer): Q4_K_M keeps half of attn_v / ffn_down in Q6_K, Q5_K_M uses Q5_K
WEIGHTS = {
    "attn_q": ((HIDDEN, HIDDEN), (Q.Q4_K, Q.Q5_K)),
    "attn_k": ((KV_HEADS * HEAD_DIM, HIDDEN), (Q.Q4_K, Q.Q5_K)),
    "attn_v": ((KV_HEADS * HEAD_DIM, HIDDEN), (Q.Q6_K, Q.Q5_K)),
    "attn_output": ((HIDDEN, HIDDEN), (Q.Q4_K, Q.Q6_K)),
    "ffn_gate": ((FFN, HIDDEN), (Q.Q4_K, Q.Q5_K)),
    "ffn_up": ((FFN, HIDDEN), (Q.Q4_K, Q.Q5_K)),
    "ffn_down": ((HIDDEN, FFN), (Q.Q6_K, Q.Q4_K)),
}
ENCODE = {Q.Q4_K: enc_q4_k, Q.Q5_K: enc_q5_k, Q.Q6_K: enc_q6_k}


def test_mixed_k_quant_model_loads_as_its_float_model(tmp_path):
    rng = np.random.default_rng(3)
    quantized, floats = {}, {}

    def add(name: str, shape: tuple[int, int], qtype: Q):
        blocks, ref = ENCODE[qtype](*shape)
        quantized[name] = (blocks.reshape(shape[0], -1), qtype)
        floats[name] = np.asarray(ref, np.float32).reshape(shape)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.Q4_K)
    add("output.weight", (VOCAB, HIDDEN), Q.Q6_K)
    for i in range(LAYERS):
        for short, (shape, types) in WEIGHTS.items():
            add(f"blk.{i}.{short}.weight", shape, types[i])
        for norm in ("attn_norm", "ffn_norm"):
            floats[f"blk.{i}.{norm}.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    floats["output_norm.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    quantized = {name: quantized.get(name, a) for name, a in floats.items()}  # norms stay F32, as llama.cpp keeps them

    q_path = write_gguf(tmp_path / "q4_k_m.gguf", "llama", META, quantized)
    f_path = write_gguf(tmp_path / "f32.gguf", "llama", META, floats)
    types = {t.qtype for t in GGUFFile(q_path).tensors.values()}
    assert types == {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32}
    cfg_q, p_q = load_model(q_path, "float32", cache=False)
    cfg_f, p_f = load_model(f_path, "float32", cache=False)
    assert cfg_q == cfg_f and (cfg_q.hidden_size, cfg_q.num_layers, cfg_q.tie_word_embeddings) == (256, 2, False)
    kept = {name: w.qtype for name, w in p_q.items() if isinstance(w, GGMLWeight)}
    kept |= {
        f"{i}.{n}": w.qtype for i, lp in enumerate(p_q["layers"]) for n, w in lp.items() if isinstance(w, GGMLWeight)
    }
    assert kept == {
        "embed": "Q4_K",
        "lm_head": "Q6_K",
        **{f"0.{n}": "Q4_K" for n in ("wq", "wk", "wo", "w_gate_up")},
        "0.wv": "Q6_K",
        "0.w_down": "Q6_K",
        **{f"1.{n}": "Q5_K" for n in ("wq", "wk", "wv", "w_gate_up")},
        "1.wo": "Q6_K",
        "1.w_down": "Q4_K",
    }
    p_q = jax.tree.map(
        lambda w: w.dequantize() if isinstance(w, GGMLWeight) else w, p_q, is_leaf=lambda w: isinstance(w, GGMLWeight)
    )
    assert jax.tree.structure(p_q) == jax.tree.structure(p_f)
    for (path, a), b in zip(jax.tree.leaves_with_path(p_q), jax.tree.leaves(p_f), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )
