"""Section `model`: the Llama-3-8B-shaped model with random bf16 weights (`load_format="dummy"`) through
`netra_jax.LLM.generate`: time to ready (build + warm-up), batch-1 decode tok/s and its memory-bandwidth use (MBU:
weight + KV bytes read per token over the measured copy bandwidth), output throughput at larger batches, and the
compilations that happen after warm-up (there should be none)."""

from __future__ import annotations

import functools
import logging
import random
import time

import jax

from gpu_check import engine_settings
from gpu_check.common import Section, sig
from gpu_check.model_dir import ensure_model_dir, kv_bytes_per_token, model_config, weight_bytes


class CompileLog(logging.Handler):
    """Names of the functions XLA compiles while `jax_log_compiles` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of "):
            self.names.append(msg[len("Finished XLA compilation of ") :].split(" ")[0])


def prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(length)]} for _ in range(n)]


def timed_generate(llm, reqs: list[dict], max_tokens: int) -> tuple[float, int]:
    from netra_jax import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def batch1(sec: Section, llm, cfg: dict) -> dict:
    """Decode speed without the prompt: (N - 1) tokens over the time between a 1-token and an N-token generate."""
    sz = sec.sizes
    n = sz.output_len
    reqs = prompts(1, sz.prompt_len, cfg["vocab_size"], seed=1)
    timed_generate(llm, reqs, 2)  # first-use costs (host buffers, sampler variant) stay out
    t1 = min(timed_generate(llm, prompts(1, sz.prompt_len, cfg["vocab_size"], seed=s), 1)[0] for s in (2, 3))
    tn, got = timed_generate(llm, prompts(1, sz.prompt_len, cfg["vocab_size"], seed=4), n)
    tok_s = (got - 1) / max(tn - t1, 1e-9)
    row = {"prompt_tokens": sz.prompt_len, "output_tokens": got, "first_token_s": sig(t1), "decode_tok_s": sig(tok_s)}
    per_token = weight_bytes(cfg) + kv_bytes_per_token(cfg) * (sz.prompt_len + n // 2)
    row["bytes_per_token_gb"] = sig(per_token / 1e9)
    if sec.copy_gbps():
        row["mbu"] = sig(per_token * tok_s / (sec.copy_gbps() * 1e9), 3)
        row["roofline_tok_s"] = sig(sec.copy_gbps() * 1e9 / per_token)
    return row


def throughput(sec: Section, llm, cfg: dict, batch: int) -> dict:
    sz = sec.sizes
    t, got = timed_generate(llm, prompts(batch, sz.prompt_len, cfg["vocab_size"], seed=batch), sz.output_len)
    return {"batch": batch, "output_tokens": got, "seconds": sig(t), "output_tok_s": sig(got / t)}


def run(sec: Section) -> None:
    from netra_jax import LLM

    path = ensure_model_dir(sec.work, sec.dry)
    cfg = model_config(sec.dry)
    kwargs = engine_settings.llm_kwargs(sec.dry)
    sec.set("engine", kwargs)
    t = time.perf_counter()
    llm = LLM(str(path), **kwargs)
    ready = time.perf_counter() - t
    runner = getattr(llm.engine, "runner", None)
    sec.set(
        "ready",
        {
            "time_to_ready_s": sig(ready),
            "attention_backend": getattr(runner, "backend", None),
            "kv_capacity_tokens": llm.engine.kv_capacity_tokens,
            "weights_gb": sig(weight_bytes(cfg) / 1e9),
        },
    )
    log = CompileLog()
    logger = logging.getLogger("jax._src.dispatch")
    logger.addHandler(log)
    jax.config.update("jax_log_compiles", True)
    try:
        sec.attempt("batch1", {}, functools.partial(batch1, sec, llm, cfg), need_s=5 if sec.dry else 20)
        for b in sec.sizes.model_batches:
            sec.attempt("throughput", {"batch": b}, functools.partial(throughput, sec, llm, cfg, b), 20)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(log)
    steps = [n for n in log.names if n.startswith(("jit(_step", "jit(_sample"))]
    sec.set("compiles_after_warmup", {"total": len(log.names), "model_steps": len(steps), "names": log.names[:20]})
