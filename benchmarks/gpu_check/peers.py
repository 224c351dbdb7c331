"""Section `peers` (a torch process, no JAX): Hugging Face `generate` (sdpa attention, dynamic cache) on a random
bf16 model of the same config and initialisation (normal(0, 0.02), norms 1: the same shapes and distribution, not
the same values: JAX's arrays live in another process) at batch 1 and 64, and PyTorch's flash SDPA on the dense
equivalents of the attention section's paged shapes. The report divides by these."""

from __future__ import annotations

import functools
import json
import time

from benchmarks.gpu_check.common import Section, decode_rate, median_time, sig
from benchmarks.gpu_check.model_dir import ensure_model_dir

ROTATE_BYTES = 256 << 20


def _torch(dry: bool):
    """(torch, device) or (None, the reason there is no peer): CUDA on the device run, the CPU allowed in a dry run."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not importable here ({e})"
    if torch.cuda.is_available():
        return torch, "cuda"
    return (torch, "cpu") if dry else (None, "torch sees no CUDA device")


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_hf(torch, path, device: str):
    import transformers

    cfg = json.loads((path / "config.json").read_text())
    config = transformers.LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("torch_dtype", "model_type")}, initializer_range=0.02
    )
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", dtype=torch.bfloat16
            )
        except TypeError:  # transformers before the dtype= spelling
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", torch_dtype=torch.bfloat16
            )
    return model.eval(), cfg


def hf_generate(torch, device, model, cfg: dict, batch: int, prompt_len: int, new: int) -> float:
    ids = torch.randint(2, cfg["vocab_size"], (batch, prompt_len), device=device)
    _sync(torch, device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    _sync(torch, device)
    assert out.shape == (batch, prompt_len + new), out.shape
    return time.perf_counter() - t


def hf_rows(sec: Section, torch, device: str, path) -> None:
    import transformers

    sz = sec.sizes
    t = time.perf_counter()
    model, cfg = build_hf(torch, path, device)
    sec.set(
        "hf",
        {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "build_s": sig(time.perf_counter() - t),
            "attention": "sdpa",
            "cache": "dynamic (a static cache pays off with torch.compile, whose compile does not fit the budget)",
            "weights": "same config and init distribution as the JAX model, different random values",
        },
    )
    gen = functools.partial(hf_generate, torch, device, model, cfg)
    for b in sz.hf_batches:

        def measure(b=b):
            gen(b, sz.prompt_len, 2)  # warm-up
            if b == 1:  # decode rate without the prompt, as the model section measures it
                n = sz.output_len
                return decode_rate(lambda i: gen(1, sz.prompt_len, 1), lambda i: gen(1, sz.prompt_len, n), n)
            tn = gen(b, sz.prompt_len, sz.output_len)
            return {"output_tok_s": sig(b * sz.output_len / tn), "seconds": sig(tn)}

        sec.attempt("hf_generate", {"batch": b}, measure, need_s=10 if sec.dry else 40)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def sdpa_rows(sec: Section, torch, device: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    sz = sec.sizes
    H, KH, D = sz.heads, sz.kv_heads, sz.head_dim
    shapes = [(f"b{b}_ctx{c}", b, 1, c) for b, c in sz.decode_grid]
    shapes += [(n, len(s), s[0][1], s[0][0] + s[0][1]) for n, s in sz.mixed_steps if len(set(s)) == 1]
    for name, B, q_len, ctx in shapes:

        def measure(B=B, q_len=q_len, ctx=ctx):
            kv_bytes = 2 * B * ctx * KH * D * 2
            copies = max(1, min(8, -(-ROTATE_BYTES // kv_bytes)))
            q = torch.randn(B, H, q_len, D, device=device, dtype=torch.bfloat16)
            kvs = [
                (
                    torch.randn(B, KH, ctx, D, device=device, dtype=torch.bfloat16),
                    torch.randn(B, KH, ctx, D, device=device, dtype=torch.bfloat16),
                )
                for _ in range(copies)
            ]
            causal = q_len > 1
            row = {}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                try:
                    sdpa(q, *kvs[0], is_causal=causal, enable_gqa=True)
                    gqa = True
                except RuntimeError as e:  # a flash build without GQA: K/V heads repeated (more bytes read)
                    kvs = [(k.repeat_interleave(H // KH, 1), v.repeat_interleave(H // KH, 1)) for k, v in kvs]
                    gqa, row["kv_expanded"] = False, f"flash refused enable_gqa: {str(e)[:200]}"
                t = median_time(
                    lambda i: sdpa(q, *kvs[i % copies], is_causal=causal, enable_gqa=gqa),
                    lambda _: _sync(torch, device),
                )
            nbytes = kv_bytes + 2 * q.numel() * 2  # the paged kernels' count: each K/V head once
            return {"us": sig(t * 1e6), "gbps": sig(nbytes / t / 1e9)} | row

        sec.attempt("flash_sdpa", {"shape": name}, measure, need_s=3 if sec.dry else 8)


def run(sec: Section) -> None:
    torch, device = _torch(sec.dry)
    if torch is None:
        sec.skip("flash_sdpa", {}, device)
        sec.skip("hf_generate", {}, device)
        return
    sdpa_rows(sec, torch, device)
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        sec.skip("hf_generate", {}, f"transformers is not importable here ({e})")
        return
    hf_rows(sec, torch, device, ensure_model_dir(sec.work, sec.dry))
