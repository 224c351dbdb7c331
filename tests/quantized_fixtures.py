"""Writes tests/fixtures/quantized/<format>/: tiny Llama checkpoints quantized and packed by the formats' own libraries,
as Hugging Face ships them (config.json with its quantization_config, model.safetensors, the tokenizer of the shared
tiny-llama fixture), each with `<format>.reference.safetensors` beside it (outside the directory, whose safetensors
files are all weights): the library's own de-quantization of every quantized weight
(`<module>.weight`, in the library's output dtype) and transformers' float32 logits (`logits` [prompt, vocab]) and
greedy tokens (`greedy_ids`) for the fixed `prompt_ids`, computed on the model holding those de-quantized weights.

Run once, with an interpreter that has torch (CPU), transformers, compressed-tensors, autoawq and gptqmodel (the tests
need none of them; the committed files were made with torch 2.14.1, transformers 5.24.0, compressed-tensors 0.20.1,
autoawq 0.2.9 and gptqmodel 7.7.0, all from PyPI):
    PEER_PYTHON tests/quantized_fixtures.py [--out tests/fixtures/quantized]

Which library makes each format (weights drawn at random; the scales are min-max, the formats' layouts are the point):
- fp8_block: transformers' FineGrainedFP8 quantizer (`Fp8Quantize`, 128x128 `weight_scale_inv`; intermediate 256 so
  gate, up and down hold several tiles; k_proj and v_proj, 64 rows, are not whole tiles and stay bf16 as transformers
  leaves them); de-quantized by its `Fp8Dequantize`.
- fp8_tensor: the `quant_method: "fp8"` static layout (e4m3 `weight`, per-tensor `weight_scale`, `input_scale`), the
  values made by compressed-tensors' FP8 preset (calculate_qparams + its float compressor), `input_scale` from the
  prompt's activations; de-quantized by compressed-tensors.
- ct_fp8_channel: compressed-tensors float-quantized, FP8_DYNAMIC (per-channel weights, dynamic per-token fp8
  activations), lm_head quantized too; de-quantized by compressed-tensors.
- ct_w4a16: compressed-tensors pack-quantized W4A16 (symmetric int4, group 128); ct_w4a16_asym: W4A16_ASYM with
  group 32 (packed zero points); de-quantized by compressed-tensors' PackedQuantizationCompressor.
- awq: AutoAWQ GEMM (its pseudo_quantize_tensor and WQLinear_GEMM.from_linear, group 64); de-quantized by its
  `dequantize_gemm`.
- gptq: GPTQModel's TorchQuantLinear.pack_original (4 bits, group 32, asymmetric, act-order g_idx shared by the
  projections reading the same input), saved in the v1 checkpoint_format (convert_gptq_v2_to_v1_format_module);
  de-quantized by its dequantize_weight."""

from __future__ import annotations

import argparse
import json
import shutil
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FROM = REPO.parent / "shared" / "fixtures" / "tiny-llama"
PROMPT_IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 2, 1]
GREEDY_TOKENS = 16
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SAME_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj"}
SAME_INPUT |= {"mlp.up_proj": "mlp.gate_proj"}  # act-order permutations follow the input (its Hessian)


def tiny_llama(dtype: torch.dtype, tie: bool, seed: int = 0, intermediate: int = 128):
    """A 1-layer Llama (hidden 128, 4 heads of 32, 2 KV heads, `intermediate`, the tokenizer's 512 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.08,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.to(dtype)


def linears(model) -> dict[str, torch.nn.Linear]:
    """Every projection (and lm_head) by module name."""
    out = {
        f"model.layers.{i}.{p}": layer.get_submodule(p)
        for i, layer in enumerate(model.model.layers)
        for p in PROJECTIONS
    }
    return out | {"lm_head": model.lm_head}


def reference(model, dequantized: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' float32 logits and greedy tokens with the de-quantized weights put in place (a fresh float32
    model: `model.to(bfloat16)` also rounded its RoPE inv_freq buffer)."""
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        m.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        for name, w in dequantized.items():
            m.get_submodule(name).weight.copy_(w.float())
        ids = torch.tensor([PROMPT_IDS])
        logits = m(ids).logits[0]  # [prompt, vocab]
        greedy = m.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"logits": logits.contiguous(), "greedy_ids": greedy[0, len(PROMPT_IDS) :].to(torch.int32).contiguous()}


def write(out: Path, model, tensors: dict[str, torch.Tensor], qc: dict, dequantized: dict[str, torch.Tensor]):
    """The checkpoint directory: config.json (with `quantization_config`), model.safetensors (the float tensors of
    `model` not replaced by `tensors`) and the tokenizer files; `<out>.reference.safetensors` beside it."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    for module in dequantized:
        state.pop(module + ".weight")
    state |= {k: v.contiguous() for k, v in tensors.items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"dtype": str(model.dtype).removeprefix("torch."), "quantization_config": qc}
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER_FROM / f, out / f)
    ref = {f"{k}.weight": v.contiguous() for k, v in dequantized.items()}
    ref |= reference(model, dequantized) | {"prompt_ids": torch.tensor(PROMPT_IDS, dtype=torch.int32)}
    save_file(ref, out.parent / f"{out.name}.reference.safetensors")


def fp8_block(out: Path):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    model = tiny_llama(torch.bfloat16, tie=True, intermediate=256)  # gate and up: two 128-row tiles each
    qc = FineGrainedFP8Config(weight_block_size=[128, 128])
    quantizer = types.SimpleNamespace(quantization_config=qc)
    tensors, deq = {}, {}
    for name, lin in linears(model).items():
        if name == "lm_head":
            continue  # transformers keeps lm_head in float (modules_to_not_convert)
        q = Fp8Quantize(quantizer).convert({f"{name}.weight": lin.weight.data})
        if f"{name}.weight_scale_inv" not in q:
            continue  # not whole 128x128 tiles: left float
        tensors |= q
        deq[name] = Fp8Dequantize(quantizer)._dequantize_one(
            q[f"{name}.weight"], q[f"{name}.weight_scale_inv"], output_dtype=torch.bfloat16
        )
    write(out, model, tensors, qc.to_dict(), deq)


def _ct_tensor(weight: torch.Tensor, scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor, type]:
    """(compressed tensors, library de-quantization, compressor) of one weight [N, K] by a compressed-tensors
    scheme: min-max qparams (calculate_qparams) per tensor, channel or group, then the format's compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    n, k = weight.shape
    if args.strategy == "tensor":
        w = weight.reshape(1, 1, -1)
    elif args.strategy == "channel":
        w = weight.reshape(n, 1, k)
    else:
        w = weight.reshape(n, k // args.group_size, args.group_size)
    zero = torch.zeros(w.shape[:2])
    lo, hi = torch.minimum(w.amin(-1).float(), zero), torch.maximum(w.amax(-1).float(), zero)
    scale, zp = calculate_qparams(lo, hi, args)  # [N or 1, groups]
    if args.strategy == "tensor":
        scale, zp = scale.reshape(1), zp.reshape(1)
    fmt = "pack-quantized" if args.type == "int" else "float-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zp}
    packed = compressor.compress(state, scheme)
    deq = compressor.decompress(dict(packed), scheme)["weight"]
    return packed, deq, fmt


def compressed_tensors(out: Path, preset: str, group: int | None = None, quantize_head: bool = False):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    kw = {k: v.model_copy() if v is not None else None for k, v in PRESET_SCHEMES[preset].items()}
    if group is not None:
        kw["weights"] = kw["weights"].model_copy(update={"group_size": group})
    scheme = QuantizationScheme(targets=["Linear"], **kw)
    model = tiny_llama(torch.bfloat16, tie=not quantize_head, seed=1)
    tensors, deq, fmt = {}, {}, None
    for name, lin in linears(model).items():
        if name == "lm_head" and not quantize_head:
            continue
        packed, deq[name], fmt = _ct_tensor(lin.weight.data, scheme)
        tensors |= {f"{name}.{k}": v for k, v in packed.items()}
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=[] if quantize_head else ["lm_head"],
    ).to_dict()
    write(out, model, tensors, qc, deq)


def fp8_tensor(out: Path):
    """vLLM's serialized FP8 layout (`quant_method: "fp8"`, activation_scheme static): the FP8 preset's per-tensor
    weight scale, and each projection's input scale (absmax / 448 over the prompt, as a static observer)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["FP8"])
    model = tiny_llama(torch.bfloat16, tie=True, seed=2)
    amax = {}
    hooks = [
        lin.register_forward_pre_hook(lambda mod, x, name=name: amax.__setitem__(name, x[0].abs().max().float()))
        for name, lin in linears(model).items()
    ]
    with torch.no_grad():
        model(torch.tensor([PROMPT_IDS]))
    for h in hooks:
        h.remove()
    tensors, deq = {}, {}
    for name, lin in linears(model).items():
        if name == "lm_head":
            continue
        packed, deq[name], _ = _ct_tensor(lin.weight.data, scheme)
        tensors[f"{name}.weight"] = packed["weight"]
        tensors[f"{name}.weight_scale"] = packed["weight_scale"].float().reshape(())
        tensors[f"{name}.input_scale"] = (amax[name] / 448.0).reshape(())
    qc = {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3", "ignored_layers": ["lm_head"]}
    write(out, model, tensors, qc, deq)


def awq(out: Path, group: int = 64):
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    quantizer = object.__new__(AwqQuantizer)  # its pseudo_quantize_tensor reads only these three
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point = 4, group, True
    model = tiny_llama(torch.float16, tie=True, seed=3)
    tensors, deq = {}, {}
    for name, lin in linears(model).items():
        if name == "lm_head":
            continue
        w, scales, zeros = quantizer.pseudo_quantize_tensor(lin.weight.data.float())
        lin.weight.data = w.to(lin.weight.dtype)  # as AutoAWQ's apply_quant: the fake-quantized weight is packed
        q = WQLinear_GEMM.from_linear(lin, 4, group, False, scales.t().contiguous(), zeros.t().contiguous())
        tensors |= {f"{name}.qweight": q.qweight, f"{name}.qzeros": q.qzeros, f"{name}.scales": q.scales}
        deq[name] = dequantize_gemm(q.qweight, q.qzeros, q.scales, 4, group).t()  # [K, N] -> [N, K]
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    write(out, model, tensors, qc | {"modules_to_not_convert": None}, deq)


def gptq(out: Path, bits: int = 4, group: int = 32):
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    model = tiny_llama(torch.float16, tie=True, seed=4)
    gen = torch.Generator().manual_seed(5)
    perms, tensors, deq = {}, {}, {}
    maxq = (1 << bits) - 1
    for name, lin in linears(model).items():
        if name == "lm_head":
            continue
        n, k = lin.weight.shape
        source = name.rsplit(".", 2)[0] + "." + SAME_INPUT.get(name.split(".", 3)[3], name.split(".", 3)[3])
        perm = perms.setdefault(source, torch.randperm(k, generator=gen))  # act-order: groups in this row order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
        w = lin.weight.data.float()
        lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(k // group)], 1).clamp(max=0)  # [N, groups]
        hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(k // group)], 1).clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=1e-5)
        zeros = torch.round(-lo / scales).clamp(1, maxq)  # >= 1: v1 stores z - 1 without borrowing
        q = TorchLinear(bits, group, False, True, k, n, pack_dtype=torch.int32, register_buffers=True)
        q.pack_original(lin, scales.half(), zeros, g_idx)
        q.post_init()
        deq[name] = q.dequantize_weight().t()  # [K, N] -> [N, K]
        convert_gptq_v2_to_v1_format_module(q, types.SimpleNamespace(bits=bits, pack_dtype=torch.int32))
        for t in ("qweight", "qzeros", "scales", "g_idx"):
            tensors[f"{name}.{t}"] = getattr(q, t)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": True, "sym": False}
    write(out, model, tensors, qc | {"checkpoint_format": "gptq", "lm_head": False}, deq)


FORMATS = {
    "fp8_block": fp8_block,
    "fp8_tensor": fp8_tensor,
    "ct_fp8_channel": lambda out: compressed_tensors(out, "FP8_DYNAMIC", quantize_head=True),
    "ct_w4a16": lambda out: compressed_tensors(out, "W4A16"),
    "ct_w4a16_asym": lambda out: compressed_tensors(out, "W4A16_ASYM", group=32),
    "awq": awq,
    "gptq": gptq,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "quantized")
    ap.add_argument("formats", nargs="*", default=list(FORMATS))
    a = ap.parse_args()
    for name in a.formats:
        FORMATS[name](a.out / name)
        files = [*(a.out / name).iterdir(), a.out / f"{name}.reference.safetensors"]
        print(name, sum(f.stat().st_size for f in files))


if __name__ == "__main__":
    main()
