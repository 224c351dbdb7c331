"""Hugging Face fixture -> GGUF file written the way llama.cpp's convert_hf_to_gguf.py writes it: its tensor names and
metadata keys, Llama-arch Q/K rows permuted, Gemma norms + 1, experts merged into `ffn_{gate,up,down}_exps`
[E, out, in] (gpt-oss: gate/up de-interleaved, optionally fused gate-then-up into `ffn_gate_up_exps`, MXFP4 experts
repacked into GGML's MXFP4 blocks), so tests can load both and compare; `requantized` rewrites a GGUF file's
tensors in one quantized type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from support.gguf_blocks import write_gguf

ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
}
TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral router
    "mlp.router": "ffn_gate_inp",  # gpt-oss router
}
EXPERT_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 (blocks [..., G, 16]: byte k = values 2k | 2k + 1 << 4; scales [..., G]) -> GGML MXFP4 bytes
    [..., G * 17] (per block: the scale byte, then byte j = values j | j + 16 << 4), as llama.cpp's
    GptOssModel.repack_mxfp4 does."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], axis=-1)  # [..., G, 17]
    return out.reshape(*out.shape[:-2], -1)


def _meta(d: dict, arch: str) -> dict:
    nh, nkv = d["num_attention_heads"], d["num_key_value_heads"]
    hd = d.get("head_dim") or d["hidden_size"] // nh
    rp = d.get("rope_parameters") or {}
    rope = rp.get("full_attention", rp)
    meta = {
        f"{arch}.context_length": d["max_position_embeddings"],
        f"{arch}.embedding_length": d["hidden_size"],
        f"{arch}.block_count": d["num_hidden_layers"],
        f"{arch}.feed_forward_length": d["intermediate_size"],
        f"{arch}.attention.head_count": nh,
        f"{arch}.attention.head_count_kv": nkv,
        f"{arch}.attention.layer_norm_rms_epsilon": float(d["rms_norm_eps"]),
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", d.get("rope_theta", 1e4))),
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(d["vocab_size"])],
        "tokenizer.ggml.eos_token_id": 2,
    }
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
        meta |= {
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": float(rope["factor"]),
            f"{arch}.rope.scaling.original_context_length": int(rope["original_max_position_embeddings"]),
            f"{arch}.rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
            f"{arch}.rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        }
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = d["sliding_window"]
        meta[f"{arch}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in d["layer_types"]]
        meta[f"{arch}.rope.freq_base_swa"] = float(rp["sliding_attention"]["rope_theta"])
    if n_experts := d.get("num_local_experts") or d.get("num_experts"):
        meta[f"{arch}.expert_count"] = n_experts
        meta[f"{arch}.expert_used_count"] = d["num_experts_per_tok"]
    if arch == "qwen3moe":
        meta[f"{arch}.expert_feed_forward_length"] = d["moe_intermediate_size"]
    if arch == "gpt-oss":
        meta[f"{arch}.expert_feed_forward_length"] = d["intermediate_size"]
        meta[f"{arch}.attention.sliding_window"] = d["sliding_window"]
    return meta


def _gpt_oss_experts(x: str, get, names, fuse: bool) -> dict:
    """gpt-oss's fused HF experts under `x` ("model.layers.<i>.mlp.experts.") as GptOssModel writes them."""
    out = {}
    if x + "gate_up_proj_blocks" in names:  # MXFP4: rows of gate and up de-interleaved, blocks repacked
        gu_b, gu_s = get(x + "gate_up_proj_blocks"), get(x + "gate_up_proj_scales")
        mx = GGMLQuantizationType.MXFP4
        gate = (_mxfp4_to_ggml(gu_b[:, 0::2], gu_s[:, 0::2]), mx)  # bytes [E, I, hidden / 32 * 17]
        up = (_mxfp4_to_ggml(gu_b[:, 1::2], gu_s[:, 1::2]), mx)
        down = (_mxfp4_to_ggml(get(x + "down_proj_blocks"), get(x + "down_proj_scales")), mx)
        gate_up = (np.concatenate([gate[0], up[0]], axis=1), mx)
    else:  # [E, hidden, 2I] interleaved -> [E, 2I, hidden], split
        gu = np.swapaxes(get(x + "gate_up_proj"), -1, -2)
        gate, up = np.ascontiguousarray(gu[:, 0::2]), np.ascontiguousarray(gu[:, 1::2])
        down = np.ascontiguousarray(np.swapaxes(get(x + "down_proj"), -1, -2))  # [E, hidden, I]
        gate_up = np.concatenate([gate, up], axis=1)
    b = get(x + "gate_up_proj_bias")
    if fuse:
        out["ffn_gate_up_exps.weight"] = gate_up
        out["ffn_gate_up_exps.bias"] = np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1)
    else:
        out["ffn_gate_exps.weight"], out["ffn_up_exps.weight"] = gate, up
        out["ffn_gate_exps.bias"] = np.ascontiguousarray(b[..., 0::2])
        out["ffn_up_exps.bias"] = np.ascontiguousarray(b[..., 1::2])
    out["ffn_down_exps.weight"], out["ffn_down_exps.bias"] = down, get(x + "down_proj_bias")
    return out


def to_gguf(model_dir: Path, out: Path, fuse_gate_up: bool = False, per_expert_tensors: bool = False) -> Path:
    """Write a HF fixture as llama.cpp's converter would. fuse_gate_up: one `ffn_gate_up_exps` tensor (the
    converter's --fuse-gate-up-exps); per_expert_tensors: old Mixtral files' `blk.N.ffn_gate.<e>.weight`."""
    from netra_jax.loader.hf import HFCheckpoint

    d = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[d["model_type"]]
    nh, nkv = d["num_attention_heads"], d["num_key_value_heads"]
    ck = HFCheckpoint(model_dir)

    def get(name: str) -> np.ndarray:
        a = ck.get(name)
        return a if a.dtype == np.uint8 else np.array(a, np.float32)

    tensors = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, kind) -> expert -> [out, in]
    gpt_oss_layers = set()
    for name in ck.keys():
        if not name.startswith("model.layers."):
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
            tensors[gname] = get(name) + (1.0 if arch == "gemma3" and gname == "output_norm.weight" else 0.0)
            continue
        _, _, i, rest = name.split(".", 3)
        if rest.startswith("mlp.experts.") and rest.count(".") == 2:
            gpt_oss_layers.add(i)  # fused experts, converted per layer below
            continue
        if ".experts." in rest:  # mlp.experts.<e>.gate_proj.weight, block_sparse_moe.experts.<e>.w1.weight
            _, e, proj, _ = rest.rsplit(".", 3)
            experts.setdefault((i, EXPERT_KINDS[proj]), {})[int(e)] = get(name)
            continue
        if rest == "self_attn.sinks":
            tensors[f"blk.{i}.attn_sinks.weight"] = get(name)
            continue
        mod, kind = rest.rsplit(".", 1)
        short = TO_GGUF.get(mod) or ("post_attention_norm" if arch in ("gemma3", "gpt-oss") else "ffn_norm")
        a = get(name)
        if arch == "llama" and short in ("attn_q", "attn_k"):  # llama.cpp LlamaModel.permute
            n = nh if short == "attn_q" else nkv
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if arch == "gemma3" and kind == "weight" and short.endswith("norm"):
            a = a + 1.0
        tensors[f"blk.{i}.{short}.{kind}"] = a
    for (i, kind), per in experts.items():
        if per_expert_tensors:
            tensors |= {f"blk.{i}.ffn_{kind}.{e}.weight": w for e, w in per.items()}
        else:
            tensors[f"blk.{i}.ffn_{kind}_exps.weight"] = np.stack([per[e] for e in sorted(per)])  # [E, out, in]
    if fuse_gate_up:
        for i in {i for i, _ in experts}:
            gate, up = tensors.pop(f"blk.{i}.ffn_gate_exps.weight"), tensors.pop(f"blk.{i}.ffn_up_exps.weight")
            tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    for i in gpt_oss_layers:
        fused = _gpt_oss_experts(f"model.layers.{i}.mlp.experts.", get, set(ck.keys()), fuse_gate_up)
        tensors |= {f"blk.{i}.{k}": v for k, v in fused.items()}
    return write_gguf(out, arch, _meta(d, arch), tensors)


def requantized(src: Path, dst: Path, qtype: str = "Q8_0") -> Path:
    """`src` with every tensor of rows of a multiple of 32 values (routers and 3-D experts too) in `qtype` (one
    `gguf.quants` can quantize: Q4_0, Q8_0, ...), the rest in F32; "F32": every tensor de-quantized (the model a
    quantized file stands for)."""
    import gguf

    kind = GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(dst, reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if qtype != "F32" and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
