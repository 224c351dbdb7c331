"""What a quantized KV cache costs in accuracy: the mean KL divergence per token of the next-token distributions
with an int8, fp8 e4m3 or fp8 e5m2 cache against the float32 cache, and each cache's perplexity, on the default model
(SmolLM2-135M-Instruct, its Q4_1 GGUF served from its blocks) over the perplexity benchmark's text and chunks.

Protocol: benchmarks/perplexity.py's (llama-perplexity's): the text tokenized once, cut into chunks of --ctx tokens
starting with BOS, each scored on its second half. Each chunk's logits at every position come from `LLM.logits`,
which runs the prompt over a cache of the engine's `kv_cache_dtype`; KL(float || quantized) is summed over the
vocabulary at each scored position (in float64) and averaged over the positions.

Usage: .venv/bin/python -m benchmarks.kv_quant_kl [MODEL] [--ctx 512] [--max-chunks 6] [--out FILE]
(default MODEL: the default model; writes benchmarks/results/kv_quant_kl.json)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from benchmarks.perplexity import DEFAULT_TEXT, chunks

HERE = Path(__file__).resolve().parent
KV_CACHE_DTYPES = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")  # the first is the baseline


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of logits [N, vocab]."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def chunk_logprobs(model: str, kv_cache_dtype: str, parts: list[list[int]], ctx: int) -> tuple[list, float]:
    """Each chunk's log-probabilities [ctx, vocab] float64 over a `kv_cache_dtype` cache, and the seconds spent."""
    from netra_jax import LLM

    llm = LLM(model, dtype="float32", kv_cache_dtype=kv_cache_dtype, max_model_len=ctx + 16, max_num_seqs=4)
    t0 = time.perf_counter()
    out = [log_softmax(llm.logits(c)) for c in parts]
    return out, time.perf_counter() - t0


def main() -> None:
    from netra_jax import LLM
    from netra_jax.assets import default_model_path
    from netra_jax.bench.machine import machine_info
    from netra_jax.bench.results import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-chunks", type=int, default=6, help="score the text's first chunks only (minutes on 2 cores)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kv_quant_kl.json")
    a = ap.parse_args()
    model = str(a.model or default_model_path())
    tok = LLM(model, dtype="float32", max_model_len=a.ctx + 16, max_num_seqs=4).get_tokenizer()
    ids = tok.encode(a.text.read_text(), add_special_tokens=True)
    bos = ids[0] if tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id else None
    parts = chunks(ids, a.ctx, bos)[: a.max_chunks]
    first = a.ctx // 2
    rows, base = {}, None
    for kv in KV_CACHE_DTYPES:
        lps, seconds = chunk_logprobs(model, kv, parts, a.ctx)
        # position j - 1's distribution predicts token j; scored: tokens first + 1 .. ctx - 1 of each chunk
        scored = [lp[first : a.ctx - 1] for lp in lps]  # [ctx - 1 - first, vocab] each
        targets = [np.asarray(c[first + 1 : a.ctx]) for c in parts]
        nll = -np.concatenate([s[np.arange(len(t)), t] for s, t in zip(scored, targets, strict=True)])
        row = {"ppl": math.exp(nll.mean()), "mean_nll": float(nll.mean()), "seconds": round(seconds, 2)}
        if base is None:
            base = scored
        else:
            kl = np.concatenate([(np.exp(p) * (p - q)).sum(-1) for p, q in zip(base, scored, strict=True)])
            row |= {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "p99_kl": float(np.quantile(kl, 0.99))}
            agree = [(p.argmax(-1) == q.argmax(-1)).mean() for p, q in zip(base, scored, strict=True)]
            row["top1_agreement"] = float(np.mean(agree))
        print(kv, row, flush=True)
        rows[kv] = row
    result = {
        "model": Path(model).name,
        "text": a.text.name,
        "ctx": a.ctx,
        "chunks": len(parts),
        "scored_tokens": len(parts) * (a.ctx - 1 - first),
        "baseline": KV_CACHE_DTYPES[0],
        "machine": machine_info(),
        "results": rows,
    }
    write_result(result, "kv_quant_kl", HERE / "results", a.out)


if __name__ == "__main__":
    main()
