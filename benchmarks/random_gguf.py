"""A Llama-shaped GGUF file of realistic size with random weights, for load, memory and speed comparisons against
llama.cpp on the same file without downloading a model: quantized with the gguf package, tokenizer copied from a GGUF.

Defaults: hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192, embeddings tied, SmolLM2's tokenizer (the default
model's file): 1.07 B parameters, 606 MB as Q4_0, 1.14 GB as Q8_0. Weights are normal with std 0.02 (norms 1), so
the model answers noise at the speed of a real one. Tensors are generated, quantized and written one at a time: the
writer holds the quantized file, never the float model.

Usage: python -m benchmarks.random_gguf OUT.gguf [--type q4_0|q4_1|q5_0|q5_1|q8_0|f16|f32] [--hidden 2048]
[--layers 16] [--heads 32] [--kv-heads 8] [--ffn 8192] [--tokenizer-from FILE.gguf] [--seed 0]
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
}
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
) -> dict:
    """Write the file (to a temporary name, then renamed); return its description: parameters, bytes, seconds."""
    if type_name not in TYPES:
        raise ValueError(f"--type {type_name!r} is not one gguf.quants writes; choose from {', '.join(TYPES)}")
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
    vocab = len(source.get_field("tokenizer.ggml.tokens").contents())

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
    for f in tokenizer_fields(source):
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)

    rng = np.random.default_rng(seed)
    params = 0

    def add_matrix(name: str, shape: tuple[int, int]) -> None:
        nonlocal params
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        params += w.size
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def add_norm(name: str) -> None:
        nonlocal params
        params += hidden
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    add_matrix("token_embd.weight", (vocab, hidden))  # tied: the lm_head reads it too
    add_norm("output_norm.weight")
    shapes = matrix_shapes(hidden, heads, kv_heads, ffn)
    for i in range(layers):
        add_norm(f"blk.{i}.attn_norm.weight")
        add_norm(f"blk.{i}.ffn_norm.weight")
        for m in LAYER_MATRICES:
            add_matrix(f"blk.{i}.{m}.weight", shapes[m])
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
        "shape": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "ffn": ffn},
        "vocab": vocab,
        "tokenizer_from": str(tokenizer_from),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="q4_0", choices=sorted(TYPES))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        info = write(a.out, a.type, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.tokenizer_from, a.seed)
    except ValueError as e:
        ap.error(str(e))
    print(
        f"{info['path']}: {info['parameters'] / 1e9:.2f} B parameters, {info['type']}, "
        f"{info['bytes'] / 1e6:.0f} MB, written in {info['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
