"""Command-line options of `netra-jax bench serve`: the parser, the prompt count of each pass of a sweep and the
options recorded in a result file."""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from netra_jax.bench import datasets as bd

DESCRIPTION = (
    "Serving benchmark: an asyncio load generator (httpx + SSE) for any OpenAI-compatible server (netra-jax, vLLM, "
    "llama.cpp's llama-server) with closed-loop concurrency sweeps, Poisson arrivals and vLLM `bench serve` metrics."
)


def prompts_per_pass(args) -> list[int]:
    """--num-prompts for each --max-concurrency value: one number for all, or a list of the same length."""
    n = args.num_prompts
    if len(n) == 1:
        return n * len(args.max_concurrency)
    if len(n) != len(args.max_concurrency):
        raise SystemExit(f"--num-prompts has {len(n)} values for {len(args.max_concurrency)} --max-concurrency values")
    return n


def run_config(args) -> dict:
    """The options that shape a run, as strict JSON (an infinite rate is the string "inf")."""
    skip = (
        "api_key",
        "plot",
        "table",
        "label",
        "result_dir",
        "no_plot",
        "disable_tqdm",
        "input_len_given",
        "output_len_given",
        "server_log",
        "launch_timeout",
    )
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    return config


def _numbers(kind):
    def parse(s: str) -> list:
        out = []
        for p in s.split(","):
            p = p.strip().lower()
            out.append(None if kind is int and p in ("0", "none", "all") else kind("inf" if p == "inf" else p))
        return out

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="netra-jax bench serve", description=DESCRIPTION)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is dropped)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument(
        "--max-concurrency",
        type=_numbers(int),
        default=[None],
        help="comma list, one pass each: requests in flight at most (0/all: no cap)",
    )
    p.add_argument(
        "--request-rate",
        type=_numbers(float),
        default=[math.inf],
        help="comma list of arrival rates in req/s (Poisson); inf: all at once",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--num-prompts", type=_numbers(int), default=[100], help="requests per pass, or one per concurrency")
    p.add_argument("--dataset", choices=bd.DATASETS, default="random")
    p.add_argument(
        "--dataset-path",
        help="jsonl: lines of {'prompt'} or {'messages'} (+ optional 'max_tokens'; a given --output-len overrides it)",
    )
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (random 1024, long 4000)")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max_tokens (random 128, long 128; jsonl: each line's own, else 128)",
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    p.add_argument("--num-turns", type=int, default=3, help="shared-prefix: user turns per conversation")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (netra-jax, vLLM, llama-server): outputs of max_tokens",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the statistics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", type=_numbers(float), default=[99.0], help="comma list, e.g. 50,90,99")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument(
        "--max-duration",
        type=float,
        default=None,
        help="seconds a pass may take: then requests not sent are dropped and those in flight cancelled (their "
        "tokens so far count in the throughput; the pass records how many were cut)",
    )
    p.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many seconds for the server")
    p.add_argument(
        "--launch", action="store_true", help="start `netra-jax serve` on a free port, run against it, then stop it"
    )
    p.add_argument(
        "--server-args",
        default="",
        metavar="'ARGS'",
        help="with --launch: model and flags of `netra-jax serve`, one string",
    )
    p.add_argument("--launch-timeout", type=float, default=1800.0, help="with --launch: seconds to wait for /ready")
    p.add_argument("--server-log", default=None, help="with --launch: server output file (default: a temp file)")
    p.add_argument("--result-dir", default=None, help="default: ./benchmarks/results if there, else ./bench-results")
    p.add_argument("--label", nargs="+", default=None, help="result name; with --plot one per file")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these result files, one line each")
    p.add_argument("--table", metavar="MD", help="with --plot: also write a markdown table of them to this file")
    p.add_argument("--disable-tqdm", action="store_true")
    a = p.parse_args(argv)
    a.base_url = re.sub(r"/v1/?$", "", a.base_url.rstrip("/"))
    a.input_len_given, a.output_len_given = a.input_len is not None, a.output_len is not None
    a.input_len = 1024 if a.input_len is None else a.input_len
    a.output_len = 128 if a.output_len is None else a.output_len
    return a
