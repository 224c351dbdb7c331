"""Perplexity of a model file over a fixed text, computed as llama.cpp's `llama-perplexity` computes it, by netra-jax
and (when its binary is given) by llama.cpp on the same file: the quantized-serving check that a model kept in its
GGML blocks scores text as llama.cpp does.

Protocol (llama-perplexity's default): the whole text is tokenized once (with BOS when the tokenizer adds one), cut
into chunks of --ctx tokens (the tail that fills no chunk is dropped); each chunk starts with BOS in place of its
first token and is scored on its second half only: the negative log-likelihood of tokens ctx/2 + 1 .. ctx - 1 given
everything before them in the chunk. PPL = exp(mean NLL). netra-jax scores each chunk as one request's prompt
logprobs (`SamplingParams(prompt_logprobs=0)`).

Usage: .venv/bin/python -m benchmarks.perplexity MODEL.gguf [MODEL2.gguf ...] [--text FILE] [--ctx 512]
       [--llama-perplexity BIN] [--matmul-backend auto|cpu_rows_q8|...]
       [--out benchmarks/results/<date>-perplexity.json]
The default text is benchmarks/prompts/perplexity_gpl3.txt (the GNU GPL version 3, verbatim: 35 KB of English
prose anyone may copy)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "prompts" / "perplexity_gpl3.txt"


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """The text's whole chunks of `ctx` tokens, each starting with `bos` (when the tokenizer adds one)."""
    out = []
    for i in range(len(tokens) // ctx):
        c = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def netra_perplexity(model: str, text: str, ctx: int, engine_args: dict) -> dict:
    """netra-jax's perplexity of `text` (see the module docstring) and what it took."""
    from netra_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=ctx + 16, max_num_seqs=4, max_num_batched_tokens=ctx, **engine_args)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    ids = tok.encode(text, add_special_tokens=True)
    bos = ids[0] if tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id else None
    parts = chunks(ids, ctx, bos)
    if not parts:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    first = ctx // 2
    t1 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": c} for c in parts],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
        use_tqdm=False,
    )
    nll, count = 0.0, 0
    for c, out in zip(parts, outs, strict=True):
        lps = out.prompt_logprobs  # [ctx]: None, then {token: Logprob} of each prompt token given the ones before
        for j in range(first + 1, ctx):
            nll -= lps[j][c[j]].logprob
            count += 1
    return {
        "ppl": math.exp(nll / count),
        "mean_nll": nll / count,
        "text_tokens": len(ids),
        "chunks": len(parts),
        "scored_tokens": count,
        "load_s": round(load_s, 2),
        "score_s": round(time.perf_counter() - t1, 2),
    }


def llama_perplexity(binary: str, model: str, text_file: Path, ctx: int, threads: int) -> dict:
    """llama.cpp's `llama-perplexity -f text -c ctx` on the same file: its final estimate."""
    t0 = time.perf_counter()
    cmd = [binary, "-m", model, "-f", str(text_file), "-c", str(ctx), "-t", str(threads), "-b", str(ctx)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks_m = re.search(r"calculating perplexity over (\d+) chunks", log)
    if proc.returncode or not m:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log[-3000:]}")
    return {
        "ppl": float(m.group(1)),
        "ppl_stderr": float(m.group(2)),
        "chunks": int(chunks_m.group(1)) if chunks_m else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary (optional)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--matmul-backend", default="auto", help="netra-jax's matmul backend (e.g. cpu_rows_q8)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    text = a.text.read_text()
    engine_args = {"dtype": "float32", "matmul_backend": a.matmul_backend}
    rows = []
    for model in a.models:
        row = {"model": Path(model).name, "netra_jax": netra_perplexity(model, text, a.ctx, engine_args)}
        if a.llama_perplexity:
            row["llama_cpp"] = llama_perplexity(a.llama_perplexity, model, a.text, a.ctx, a.threads)
            row["ratio"] = round(row["netra_jax"]["ppl"] / row["llama_cpp"]["ppl"], 5)
        print(json.dumps(row))
        rows.append(row)
    from netra_jax.bench.machine import machine_info
    from netra_jax.bench.results import write_result

    result = {
        "text": a.text.name,
        "ctx": a.ctx,
        "engine_args": engine_args,
        "machine": machine_info(),
        "results": rows,
    }
    write_result(result, "perplexity", HERE / "results", a.out)


if __name__ == "__main__":
    main()
