"""A Llama-shaped GGUF file of realistic size with random weights, for load, memory and speed comparisons against
llama.cpp on the same file without downloading a model: quantized with the gguf package, tokenizer copied from a GGUF.

Defaults: hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192, embeddings tied, SmolLM2's tokenizer (the default
model's file): 1.07 B parameters, 606 MB as Q4_0, 1.14 GB as Q8_0, 680 MB as Q4_K_M. `--shape llama3-8b` gives
Llama-3.1-8B's shapes (hidden 4096, 32 layers, 32 / 8 heads, FFN 14336, a separate output matrix, 128256 tokens:
SmolLM2's vocabulary padded with reserved control tokens as Llama 3's own are): 8.03 B parameters, 4.9 GB as Q4_K_M.
Weights are normal with std 0.02 (norms 1), so the model answers noise at the speed of a real one. Tensors are
generated, quantized and written one at a time: the writer holds the quantized file, never the float model.

Types: those gguf.quants.quantize writes, and "q4_k_m", llama-quantize's Q4_K_M mix (llama-quant.cpp's rule for
Llama-shaped models): Q4_K everywhere except attn_v and ffn_down of the layers `use_more_bits` picks (the first and
last eighth, every third between) and the output matrix (or the tied embedding), which are Q6_K. The K-quant blocks
are encoded here (`quantize_q4_k`, `quantize_q6_k`: min / max scales per sub-block, without llama.cpp's search for the
best scale), their layout checked against gguf.quants' de-quantization by tests/benchmarks/test_random_gguf.py.

Usage: python -m benchmarks.random_gguf OUT.gguf [--type q4_0|q4_1|q5_0|q5_1|q8_0|q4_k_m|f16|f32]
[--shape 1b|llama3-8b] [--hidden H] [--layers L] [--heads N] [--kv-heads N] [--ffn F] [--vocab V] [--untied]
[--tokenizer-from FILE.gguf] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

# the types gguf.quants.quantize writes, with the file type llama.cpp records for a file mostly of that type
TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (gguf.GGMLQuantizationType.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (gguf.GGMLQuantizationType.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_k_m": (gguf.GGMLQuantizationType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),  # the mix: see `mix_type`
}
SHAPES = {  # --shape: hidden, layers, heads, kv_heads, ffn, vocab (None: the tokenizer's), tied embeddings
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=None, tied=True),
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False),
}
QK_K = 256
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def matrix_shapes(hidden: int, heads: int, kv_heads: int, ffn: int) -> dict[str, tuple[int, int]]:
    """Each layer matrix as numpy holds it for GGUF: [out_features, in_features]."""
    head_dim = hidden // heads
    return {
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }


def tokenizer_fields(reader: gguf.GGUFReader) -> list[gguf.ReaderField]:
    return [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v and ffn_down get more bits in the *_K_M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_type(type_name: str, tensor: str, layer: int | None, layers: int) -> gguf.GGMLQuantizationType:
    """The GGML type of one matrix: the file's type, or for "q4_k_m" llama-quantize's Q4_K_M rule for Llama-shaped
    models (tensor: "attn_v", ..., "output"; the tied embedding counts as the output)."""
    qtype = TYPES[type_name][0]
    if type_name != "q4_k_m":
        return qtype
    if tensor == "output" or (tensor in ("attn_v", "ffn_down") and use_more_bits(layer, layers)):
        return gguf.GGMLQuantizationType.Q6_K
    return qtype


def _f16(x: np.ndarray) -> np.ndarray:  # [n] float -> [n, 2] bytes of IEEE half
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w float32 [rows, K] (K a multiple of 256) -> Q4_K blocks uint8 [rows, K / 256 * 144] (ggml-common.h's
    block_q4_K: d, dmin, scales[12], qs[128]); a value is d * sc * q - dmin * m, sc and m 6-bit per 32 values."""
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=-1), 0.0)  # [blocks, 8]
    scale, mins = (x.max(axis=-1) - lo) / 15.0, -lo
    d = np.float16(scale.max(axis=-1) / 63.0).astype(np.float32)  # [blocks], rounded as stored
    dmin = np.float16(mins.max(axis=-1) / 63.0).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.int64)  # [blocks, 8]
    m = np.clip(np.rint(_safe_div(mins, dmin[:, None])), 0, 63).astype(np.int64)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_safe_div(x + offset, step)), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # values 64p + l low nibble, 64p + 32 + l high
    packed = np.empty((x.shape[0], 12), np.uint8)  # get_scale_min_k4's layout: j < 4 direct, j >= 4 split
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    blocks = np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1)  # [blocks, 144]
    return blocks.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w float32 [rows, K] (K a multiple of 256) -> Q6_K blocks uint8 [rows, K / 256 * 210] (block_q6_K: ql[128],
    qh[64], scales[16] int8, d); a value is d * sc * (q - 32), sc per 16 values, q 6-bit."""
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, sub-blocks, 16]
    scale = np.abs(x).max(axis=-1) / 31.0  # [blocks, 16]
    d = np.float16(scale.max(axis=-1) / 127.0).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(x, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # value 128h + 32k + l: low nibble in ql[64h + 32 (k & 1) + l] (high half of the byte for k >= 2), its two high
    # bits at bits 2k of qh[32h + l]
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """w float32 [rows, K] as `qtype`'s blocks (or values, for the float types) as GGUFWriter.add_tensor takes them."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return w
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(w)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w, qtype)


def write(
    out: Path,
    type_name: str = "q4_0",
    hidden: int = 2048,
    layers: int = 16,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 8192,
    tokenizer_from: Path | None = None,
    seed: int = 0,
    vocab: int | None = None,
    tied: bool = True,
) -> dict:
    """Write the file (to a temporary name, then renamed); return its description: parameters, bytes, seconds.
    vocab: rows of the embedding (None: the tokenizer's tokens; more pads the vocabulary with reserved control
    tokens); tied: the lm_head reads the embedding (else an output matrix of its own)."""
    if type_name not in TYPES:
        raise ValueError(f"--type {type_name!r} is not one this writes; choose from {', '.join(TYPES)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden}, heads {heads}, kv_heads {kv_heads}: heads must divide both evenly")
    qtype, file_type = TYPES[type_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if hidden % block or ffn % block:
        raise ValueError(
            f"{type_name} packs rows in blocks of {block}: hidden {hidden} and ffn {ffn} must be multiples"
        )
    if tokenizer_from is None:
        from netra_jax.assets import default_model_path

        tokenizer_from = default_model_path(quiet=True)
    source = gguf.GGUFReader(tokenizer_from, "r")
    fields = {f.name: f for f in tokenizer_fields(source)}
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    vocab = vocab or len(tokens)
    if vocab < len(tokens):
        raise ValueError(f"--vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")

    t0 = time.perf_counter()
    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"random-llama-{type_name}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    reserved = vocab - len(tokens)  # Llama 3's way of rounding a vocabulary up: unused control tokens
    for name, f in fields.items():
        value, sub = f.contents(), (f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
        if name == "tokenizer.ggml.tokens":
            value = tokens + [f"<|reserved_special_token_{i}|>" for i in range(reserved)]
        elif name == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.CONTROL)] * reserved
        elif name == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * reserved
        writer.add_key_value(name, value, f.types[0], sub_type=sub)

    rng = np.random.default_rng(seed)
    params = 0

    def add_matrix(name: str, shape: tuple[int, int], kind: str, layer: int | None = None) -> None:
        nonlocal params
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        params += w.size
        t = mix_type(type_name, kind, layer, layers)
        if t == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize(w, t), raw_dtype=t)

    def add_norm(name: str) -> None:
        nonlocal params
        params += hidden
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    add_matrix("token_embd.weight", (vocab, hidden), "output" if tied else "token_embd")  # tied: the lm_head's too
    add_norm("output_norm.weight")
    if not tied:
        add_matrix("output.weight", (vocab, hidden), "output")
    shapes = matrix_shapes(hidden, heads, kv_heads, ffn)
    for i in range(layers):
        add_norm(f"blk.{i}.attn_norm.weight")
        add_norm(f"blk.{i}.ffn_norm.weight")
        for m in LAYER_MATRICES:
            add_matrix(f"blk.{i}.{m}.weight", shapes[m], m, i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return {
        "path": str(out),
        "type": type_name,
        "parameters": params,
        "bytes": out.stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
        "shape": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "tied": tied},
        "vocab": vocab,
        "tokenizer_from": str(tokenizer_from),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="q4_0", choices=sorted(TYPES))
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES), help="the defaults of the shape flags below")
    for flag in ("hidden", "layers", "heads", "kv-heads", "ffn", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--untied", action="store_true", help="an output matrix of its own (llama3-8b's default)")
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shape = dict(SHAPES[a.shape])
    for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)
    shape["tied"] = shape["tied"] and not a.untied
    try:
        info = write(a.out, a.type, tokenizer_from=a.tokenizer_from, seed=a.seed, **shape)
    except ValueError as e:
        ap.error(str(e))
    print(
        f"{info['path']}: {info['parameters'] / 1e9:.2f} B parameters, {info['type']}, "
        f"{info['bytes'] / 1e6:.0f} MB, written in {info['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
