"""What an RL trainer pays to share an engine: seconds for `LLM.update_params` and for `sleep` / `wake_up`, on a
Llama-3.2-1B-shaped model with random weights (`load_format="dummy"`, a config.json and a synthetic tokenizer, no
checkpoint), and the speed cost of the batch-invariant engine (`batch_invariant=True`, whose logprobs
`netra_jax.rl.sequence_logprobs` reproduces bit for bit) against the default one, in ms per step.

Swaps (`measure_swaps`, also run by the GPU check's model section on its Llama-3-8B-shaped model): update_params with
- "host arrays": numpy copies (weights coming from another process or device): copied to the device;
- "same arrays": a tree mapped over `llm.params` (what a trainer holding the engine's arrays hands back): referenced;
- "loader layout": q, k and v apart (`load_model`'s layout; a CPU engine holds them joined and concatenates them);
- "new device arrays": fresh arrays in the engine's layout and placement (a trainer's updated weights): referenced;
then sleep(level=1) / wake_up() (the KV cache deleted, then allocated zeroed) and sleep(level=2) / wake_up() (the
weights to host memory and back). Each the median over repeats, after a greedy check that generation is unchanged.

Batch-invariant cost (`step_costs`, on the default model's F32 copy): a prompt's prefill step and decode steps at 1
and 8 users, default engine against batch_invariant, both warmed up, measured in turns, min over repeats.

Writes benchmarks/results/<date>-rl_swap.json with the machine (CPU model and speed flags, jax versions).
Usage: .venv/bin/python -m benchmarks.rl_swap [--dtype float32] [--repeats 5] [--skip-invariant] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
LLAMA32_1B = {  # Llama-3.2-1B's shapes (tied embeddings as the checkpoint has them)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
PROMPT_IDS = list(range(2, 130))  # 128 tokens


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls (fn waits for its device work)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _greedy(llm) -> list[int]:
    from netra_jax import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT_IDS[:32]}, sp, use_tqdm=False)[0].outputs[0].token_ids


def _ready(llm) -> None:
    jax.block_until_ready((llm.engine.runner.params, llm.engine.runner.kv))


def _loader_layout(params) -> dict:
    """The live weights with a joined wqkv split back into wq, wk, wv (biases too): `load_model`'s layout."""
    from netra_jax.models.frozen_params import unfreeze

    tree = unfreeze(params)
    layers = []
    for lp in tree["layers"]:
        if "wqkv" in lp:
            lp = dict(lp)
            n = lp["wqkv"].shape[1]
            kv = (n - lp["wo"].shape[0]) // 2
            q = n - 2 * kv
            wqkv = lp.pop("wqkv")
            lp["wq"], lp["wk"], lp["wv"] = wqkv[:, :q], wqkv[:, q : q + kv], wqkv[:, q + kv :]
            if "bqkv" in lp:
                b = lp.pop("bqkv")
                lp["bq"], lp["bk"], lp["bv"] = b[:q], b[q : q + kv], b[q + kv :]
        layers.append(lp)
    return {**tree, "layers": jax.block_until_ready(layers)}


def measure_swaps(llm, repeats: int = 3) -> dict:
    """Median seconds of each weight swap and sleep / wake-up of `llm` (see the module docstring); the weights' GB,
    whether greedy tokens stayed the same after each, and the device's bytes in use asleep (accelerators). The swaps
    run while the KV cache sleeps, as a trainer's would: its copy of the weights needs the room."""
    gb = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(llm.params)) / 1e9
    before = _greedy(llm)
    dev = jax.devices()[0]
    in_use = lambda: (dev.memory_stats() or {}).get("bytes_in_use") if dev.platform != "cpu" else None  # noqa: E731
    out: dict = {"weights_gb": round(gb, 3)}
    out["kv_cache_gb"] = round(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(llm.engine.runner.kv)) / 1e9, 3)
    if in_use() is not None:
        out["device_bytes_in_use_awake_gb"] = round(in_use() / 1e9, 3)
    for level in (1, 2):
        sleep_s, wake_s, asleep = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.sleep(level=level)
            sleep_s.append(time.perf_counter() - t0)
            asleep.append(in_use())
            t0 = time.perf_counter()
            llm.wake_up()
            _ready(llm)
            wake_s.append(time.perf_counter() - t0)
        row = {"sleep_s": round(statistics.median(sleep_s), 5), "wake_up_s": round(statistics.median(wake_s), 5)}
        row["greedy_unchanged"] = _greedy(llm) == before
        if asleep[0] is not None:
            row["device_bytes_in_use_asleep_gb"] = round(asleep[-1] / 1e9, 3)
        out[f"sleep_level_{level}"] = row
    llm.sleep(level=1)
    try:
        out |= _update_times(llm, repeats, gb)
    finally:
        llm.wake_up()
    out["greedy_unchanged_after_updates"] = _greedy(llm) == before
    return out


def _update_times(llm, repeats: int, gb: float) -> dict:
    """update_params' median seconds per kind of tree (one tree besides the engine's alive at a time: a 1B float32
    model's copies fill a small machine); the engine is left on fresh device arrays."""

    def update(tree):
        llm.update_params(tree)
        _ready(llm)

    def timed(make) -> float:  # the tree is built outside the timing and dropped on return
        tree = make()
        return _timed(lambda: update(tree), repeats)

    times = {"host arrays": timed(lambda: jax.tree.map(np.array, jax.device_get(llm.params)))}  # own copies
    times["same arrays"] = timed(lambda: jax.tree.map(lambda a: a, llm.params))
    fresh = jax.block_until_ready(jax.tree.map(lambda a: a + 0, llm.params))  # new arrays, the engine's placement
    if any("wqkv" in lp for lp in fresh["layers"]):
        times["loader layout"] = timed(lambda: _loader_layout(fresh))
    times["new device arrays"] = timed(lambda: fresh)  # (swapped in from the loader layout's tree first)
    live = jax.tree.leaves(llm.engine.params)
    referenced = all(a is b for a, b in zip(live, jax.tree.leaves(fresh), strict=True))
    return {
        "update_params_s": {k: round(v, 5) for k, v in times.items()},
        "host_copy_gb_s": round(gb / times["host arrays"], 2),
        "new_device_arrays_referenced": referenced,
    }


def write_model_dir(path: Path, config: dict) -> Path:
    """config.json, generation_config.json and a synthetic tokenizer (the GPU check's) in `path`."""
    from benchmarks.gpu_check.model_dir import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_tokenizer(path, config["vocab_size"])
    return path


def step_costs(model: str, repeats: int) -> dict:
    """ms per step of the default engine, the batch-invariant one and (for reference) the default with XLA's matmuls
    (no C++ decode layers), all built and warmed up first, then measured in turns (load from other processes hits
    them alike; min over repeats): a 128-token prompt's prefill (one step), decode steps at 1 and 8 users
    ((t(1 + N tokens) - t(1 token)) / N)."""
    from netra_jax import LLM, SamplingParams

    engines = {
        "default": LLM(model, dtype="float32", max_num_seqs=8, warmup=True),
        "batch_invariant": LLM(model, dtype="float32", max_num_seqs=8, warmup=True, batch_invariant=True),
        "default, XLA matmuls": LLM(model, dtype="float32", max_num_seqs=8, warmup=True, matmul_backend="xla"),
    }

    def gen(llm, n: int, users: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        reqs = [{"prompt_token_ids": [i + 2, *PROMPT_IDS]} for i in range(users)]  # no hits between them
        llm.reset_prefix_cache()  # nor from the previous round: every prompt is prefilled whole
        return _timed(lambda: llm.generate(reqs, sp, use_tqdm=False), 1)

    n = 16
    cases = {"prefill_128_tokens_ms": (1, 1), "decode_1_users_ms_per_step": (1 + n, 1)}
    cases |= {"decode_8_users_ms_per_step": (1 + n, 8), "_one_token_1": (1, 1), "_one_token_8": (1, 8)}
    best = {name: dict.fromkeys(cases, float("inf")) for name in engines}
    load = [round(os.getloadavg()[0], 2)]
    for r in range(repeats + 1):  # the first round: first calls (host buffers), not counted
        for name, llm in engines.items():
            for case, (tokens, users) in cases.items():
                t = gen(llm, tokens, users)
                if r:
                    best[name][case] = min(best[name][case], t)
    load.append(round(os.getloadavg()[0], 2))
    rows = {}
    for name, b in best.items():
        llm = engines[name]
        rows[name] = {
            "backends": [llm.engine.runner.backend, llm.engine.runner.matmul_backend],
            "prefill_128_tokens_ms": round(b["prefill_128_tokens_ms"] * 1e3, 1),
            "decode_1_users_ms_per_step": round((b["decode_1_users_ms_per_step"] - b["_one_token_1"]) / n * 1e3, 2),
            "decode_8_users_ms_per_step": round((b["decode_8_users_ms_per_step"] - b["_one_token_8"]) / n * 1e3, 2),
        }
    base, inv = rows["default"], rows["batch_invariant"]
    rows["slowdown"] = {k: round(inv[k] / base[k], 2) for k in base if k != "backends"}
    rows["load_average_before_after"] = load
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", help="the 1B model's dtype (float32: the CPU engine joins q, k, v)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-invariant", action="store_true", help="only the swaps")
    ap.add_argument("--out", default=None, help="result file (default: benchmarks/results/<date>-rl_swap.json)")
    a = ap.parse_args(argv)
    from netra_jax import LLM
    from netra_jax.bench.gguf_f32 import default_f32
    from netra_jax.bench.machine import machine_info
    from netra_jax.bench.results import write_result

    result = {
        "benchmark": "rl_swap",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_dir(Path(tmp) / "llama32-1b", LLAMA32_1B)
        t0 = time.perf_counter()
        llm = LLM(str(path), dtype=a.dtype, load_format="dummy", max_num_seqs=8, kv_cache_memory=1 << 30)
        result["swap_model"] = {
            "shape": "Llama-3.2-1B",
            "dtype": a.dtype,
            "build_s": round(time.perf_counter() - t0, 1),
        }
        result["swaps"] = measure_swaps(llm, a.repeats)
        print(json.dumps(result["swaps"], indent=1), flush=True)
        del llm
    if not a.skip_invariant:
        model = str(default_f32())
        result["invariant_model"] = Path(model).name
        result["step_costs"] = step_costs(model, a.repeats)
        print(json.dumps(result["step_costs"], indent=1), flush=True)
    write_result(result, "rl_swap", HERE / "results", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
