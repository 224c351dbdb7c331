"""The cost of serving LoRA adapters: a decode step's time with B running sequences (default 8 and 32) on an engine
without LoRA, and on one with `--max-loras` slots of rank `--rank` whose requests use 0, 1 or 4 distinct adapters
(random adapters on every projection, in memory), on SmolLM2's F32 copy by default (`netra_jax.bench.gguf_f32`:
float32 weights, whose decode layers run as one C++ call each, adapters included).

Usage: `.venv/bin/python -m benchmarks.step_profile lora [--batches 8 32] [--adapters 0 1 4] [--max-loras 4]
[--rank 16] [--steps 12] [--repeats 3] [--model PATH] [--out FILE]`
Each measurement admits B requests of `--prompt-len` random tokens, steps until every one has its first token (the
prefills), then times `--steps` engine steps of pure decode; the figure is the median step over `--repeats` runs,
the configurations interleaved. Writes benchmarks/results/<date>-lora_step.json and prints a table with each
configuration's ratio to the engine without LoRA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.step_profile import common


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=3, model_help="a float checkpoint (default: SmolLM2-135M-Instruct's F32 copy)")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4], help="distinct adapters among the requests")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=64)


def random_adapters(cfg, n: int, rank: int, seed: int = 0) -> list:
    """`n` LoRA adapters of rank `rank` on every projection of every layer, factors ~ N(0, 0.02)."""
    from netra_jax.models.lora import LoRAAdapter, target_shapes

    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        weights = {}
        for i in range(cfg.num_layers):
            for t, (fan_in, fan_out) in target_shapes(cfg, i).items():
                a = rng.normal(0, 0.02, (fan_in, rank)).astype(np.float32)
                b = rng.normal(0, 0.02, (rank, fan_out)).astype(np.float32)
                weights[(i, t)] = (a, b)
        out.append(LoRAAdapter(name=f"random-{k}", rank=rank, weights=weights))
    return out


def decode_step_s(llm, batch: int, loras: list, a: argparse.Namespace, seed: int) -> float:
    """Median seconds of an engine step decoding `batch` sequences, request i with loras[i % len(loras)]."""
    from netra_jax import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=a.steps + 8, temperature=0, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = f"lora-bench-{seed}-{i}"
        prompt = {"prompt_token_ids": rng.integers(10, min(1000, engine.vocab_size), a.prompt_len).tolist()}
        engine.add_request(rid, prompt, params, lora_request=loras[i % len(loras)] if loras else None)
        ids.append(rid)
    started: set[str] = set()
    while len(started) < batch:  # prefills, until every request has its first token
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.settle()
    return statistics.median(times)


def run(a: argparse.Namespace) -> int:
    from netra_jax import LoRARequest
    from netra_jax.bench.gguf_f32 import default_f32

    if max(a.adapters) > a.max_loras:
        raise common.OptionError(f"--adapters up to --max-loras ({a.max_loras})")
    record = common.Run("lora_step")
    options = dict(max_num_seqs=max(a.batches), max_num_batched_tokens=max(256, max(a.batches)), warmup=False)
    model = a.model or str(default_f32())  # float32 weights (the default Q4_1 file stays in its GGML blocks)
    llms = {
        "no LoRA": common.build_llm(model, **options),
        "LoRA": common.build_llm(model, **options, enable_lora=True, max_loras=a.max_loras, max_lora_rank=a.rank),
    }
    adapters = random_adapters(llms["LoRA"].engine.model_config, max(a.adapters), a.rank)
    requests = [LoRARequest(x.name, k + 1, adapter=x) for k, x in enumerate(adapters)]
    configs = [("no LoRA", 0)] + [("LoRA", n) for n in a.adapters]
    rows = []
    for batch in a.batches:
        for name, n in configs:  # compile this batch's steps once, untimed
            decode_step_s(llms[name], batch, requests[:n], a, seed=0)
        samples: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for rep in range(a.repeats):
            for name, n in common.alternating(configs, rep):
                samples[(name, n)].append(decode_step_s(llms[name], batch, requests[:n], a, seed=rep + 1))
        base = statistics.median(samples[("no LoRA", 0)])
        for name, n in configs:
            ms = 1e3 * statistics.median(samples[(name, n)])
            rows.append({"batch": batch, "engine": name, "adapters": n, "step_ms": ms, "ratio": ms / (1e3 * base)})
            print(f"batch {batch:3d} | {name:8s} | {n} adapters | step {ms:7.2f} ms | x{ms / (1e3 * base):.2f}")
    doc = record.record(
        model=common.model_label(a.model) if a.model else "SmolLM2-135M-Instruct F32 (default)",
        dtype="float32",
        max_loras=a.max_loras,
        rank=a.rank,
        prompt_len=a.prompt_len,
        steps=a.steps,
        repeats=a.repeats,
        rows=rows,
    )
    record.write(doc, a.out)
    return 0
