"""int8 weight-only decode against float32 on the default model (SmolLM2-135M-Instruct's F32 copy), offline, one
engine at a time in one process: time per output token at one user and output tok/s at several, for float32,
`--quantization int8` (its decode rows on the C++ int8 kernel) and int8 with `--matmul-backend xla` (XLA's dot of the
widened weight).

Batch-1 time per output token: (time of a 1+N-token generation - time of a 1-token one) / N, each the minimum over
repeats, so the prompt's prefill cancels out. At B users: B copies of the prompt, N tokens each, output tok/s.
Writes benchmarks/results/<date>-int8_decode.json and .md (with the machine's CPU and its speed flags).

--float32-only runs the first alone (for a quantized GGUF file, whose blocks it serves as they are); --name names the
result files <date>-<name>.json and .md.

Usage: .venv/bin/python -m benchmarks.int8_decode [--tokens 64] [--users 8] [--repeats 3] [--out DIR]
       [--model FILE] [--float32-only] [--name int8_decode]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "int8, XLA dot": {"quantization": "int8", "matmul_backend": "xla"},
}
PROMPT = "Tell me a story about a dragon who learns to bake bread."


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(model: str, options: dict, tokens: int, users: list[int], repeats: int) -> dict:
    from netra_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", max_num_seqs=max(users), warmup=True, **options)
    ready_s = time.perf_counter() - t0

    def gen(n: int, copies: int = 1):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return lambda: llm.generate([PROMPT] * copies, params, use_tqdm=False)

    gen(8)()  # first calls of the step variants a generation uses
    one = best_of(repeats, gen(1))
    many = best_of(repeats, gen(1 + tokens))
    tpot = (many - one) / tokens
    row = {"options": options, "ready_s": round(ready_s, 1), "tpot_ms": round(tpot * 1e3, 2)}
    row["tok_s"] = {"1": round(1 / tpot, 1)}
    for b in users:
        if b > 1:
            row["tok_s"][str(b)] = round(b * tokens / best_of(max(1, repeats - 1), gen(tokens, b)), 1)
    text = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    row["greedy_text"] = text
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--users", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--model", default=None, help="a float GGUF file or HF directory (default: the default model's F32 copy)"
    )
    ap.add_argument("--float32-only", action="store_true", help="only the float32 engine")
    ap.add_argument("--name", default="int8_decode", help="result files <date>-<name>.json and .md")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args(argv)
    from netra_jax.bench.gguf_f32 import default_f32
    from netra_jax.bench.machine import describe, machine_info

    model = a.model or str(default_f32())  # float32 weights: the F32 copy (the Q4_1 file itself stays in its blocks)
    users = sorted({1, *(int(u) for u in a.users.split(","))})
    engines = {"float32": ENGINES["float32"]} if a.float32_only else ENGINES
    result = {
        "benchmark": "int8_decode",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "machine": machine_info(),
        "tokens": a.tokens,
        "users": users,
        "engines": {},
    }
    for name, options in engines.items():
        row = measure(model, options, a.tokens, users, a.repeats)
        result["engines"][name] = row
        print(f"{name}: TPOT {row['tpot_ms']} ms, tok/s {row['tok_s']}", flush=True)
    base = result["engines"]["float32"]
    for row in result["engines"].values():
        row["speed_vs_float32"] = {b: round(row["tok_s"][b] / base["tok_s"][b], 2) for b in row["tok_s"]}

    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{result['date'][:10]}-{a.name}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# int8 weight-only decode against float32, {result['date'][:10]}",
        "",
        f"{Path(model).name} on {describe(result['machine'])}; {a.tokens} output tokens, greedy, ignore_eos; "
        f"one engine at a time in one process (`python -m benchmarks.int8_decode`).",
        "",
        "| engine | TPOT at 1 user ms | " + " | ".join(f"tok/s at {b}" for b in users) + " | vs float32 |",
        "|---|---:|" + "---:|" * len(users) + "---|",
    ]
    for name, row in result["engines"].items():
        ratios = ", ".join(f"{row['speed_vs_float32'][str(b)]}x at {b}" for b in users)
        cells = " | ".join(str(row["tok_s"][str(b)]) for b in users)
        lines.append(f"| {name} | {row['tpot_ms']} | {cells} | {ratios} |")
    lines += ["", "Greedy answers (24 tokens):", ""]
    lines += [f"- {name}: {row['greedy_text']!r}" for name, row in result["engines"].items()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
