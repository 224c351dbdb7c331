"""Section `model`: the Llama-3.1-8B-shaped model with random bf16 weights (`load_format="dummy"`) through
`netra_jax.LLM.generate`, sized and compiled as the `serve` section's server (the carried bundle when there is one):
time to ready (build + warm-up), batch-1 decode tok/s and its memory-bandwidth use (MBU: weight + KV bytes read per
token over the measured copy bandwidth), a `jax.profiler` trace of steady decode at 1 and 256 users summarized
(`gpu_check.profile`: device time per kernel class, kernels per step, device idle between steps, host time per
step), and the compilations that happen after warm-up (there should be none); then an RL trainer's weight swaps and
sleep / wake-up times on it (`benchmarks.rl_swap.measure_swaps`) if time is left.

The warm-up is the engine's (`LLMEngine.warmup`: every step variant, then the sampler variants), run here one step
variant at a time, the ones the benchmarks use first, under a time cap, with each compile timed (programs loaded
from the bundle only run). When the cap stops it, the report gives the shapes compiled, their mean compile time and
the full warm-up that implies, and the benchmarks compile the rest as they meet them (counted as compilations after
warm-up)."""

from __future__ import annotations

import functools
import logging
import random
import time

import jax

from benchmarks.gpu_check import engine_settings
from benchmarks.gpu_check.bundles import carried
from benchmarks.gpu_check.common import Section, decode_rate, sig
from benchmarks.gpu_check.model_dir import ensure_model_dir, kv_bytes_per_token, model_config, weight_bytes
from benchmarks.rl_swap import measure_swaps


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


def batch1(sec: Section, llm, cfg: dict, weights: int | None = None) -> dict:
    """Decode speed without the prompt: (N - 1) tokens over the time between a 1-token and an N-token generate.
    `weights`: the bytes a token reads of them (default: the bf16 model's)."""
    sz = sec.sizes
    n = sz.output_len
    reqs = prompts(1, sz.prompt_len, cfg["vocab_size"], seed=1)
    timed_generate(llm, reqs, 2)  # first-use costs (host buffers, sampler variant) stay out

    def gen(max_tokens: int, seed: int) -> float:
        secs, got = timed_generate(llm, prompts(1, sz.prompt_len, cfg["vocab_size"], seed=seed), max_tokens)
        assert got == max_tokens, (got, max_tokens)
        return secs

    row = {"prompt_tokens": sz.prompt_len, "output_tokens": n}
    row |= decode_rate(lambda i: gen(1, 10 + i), lambda i: gen(n, 10 + i), n)
    tok_s = row["decode_tok_s"]
    per_token = (weight_bytes(cfg) if weights is None else weights) + kv_bytes_per_token(cfg) * (sz.prompt_len + n // 2)
    row["bytes_per_token_gb"] = sig(per_token / 1e9)
    if sec.copy_gbps():
        row["mbu"] = sig(per_token * tok_s / (sec.copy_gbps() * 1e9), 3)
        row["roofline_tok_s"] = sig(sec.copy_gbps() * 1e9 / per_token)
    return row


def throughput(sec: Section, llm, cfg: dict, batch: int) -> dict:
    """Output tokens per second of `batch` prompts generated together, after a short pass at the same batch size
    (its step variants compile there if the capped warm-up did not reach them)."""
    sz = sec.sizes
    timed_generate(llm, prompts(batch, sz.prompt_len, cfg["vocab_size"], seed=-batch), 2)
    t, got = timed_generate(llm, prompts(batch, sz.prompt_len, cfg["vocab_size"], seed=batch), sz.output_len)
    return {"batch": batch, "output_tokens": got, "seconds": sig(t), "output_tok_s": sig(got / t)}


def profile(sec: Section, llm, cfg: dict, users: int) -> dict:
    """A `jax.profiler` trace of `users` short prompts generated together for `profile_tokens` tokens (steady
    decode after one prefill step), summarized by `gpu_check.profile`; the trace files stay in the work directory."""
    from benchmarks.gpu_check import profile as prof

    sz = sec.sizes
    timed_generate(llm, prompts(users, sz.prompt_len, cfg["vocab_size"], seed=-users), 2)  # first-use costs out
    reqs = prompts(users, sz.prompt_len, cfg["vocab_size"], seed=users)
    done: dict = {}

    def generate() -> None:
        done["seconds"], done["tokens"] = timed_generate(llm, reqs, sz.profile_tokens)

    summary = prof.summarize(prof.capture(generate, sec.work / f"profile-{users}"))
    out = {"output_tokens": done["tokens"], "output_tok_s": sig(done["tokens"] / done["seconds"])}
    return out | summary


def step_sizes(sec: Section, settings: dict) -> list[int]:
    """Token counts of the steps the benchmarks below run: their variants are compiled first."""
    sz, budget = sec.sizes, settings["max_num_batched_tokens"]
    sizes = [1, sz.prompt_len]
    for b in sz.profile_users:
        sizes += [b, min(b * sz.prompt_len, budget)]
    return sizes


def warm_up(engine, first: list[int], cap_s: float) -> dict:
    """`engine.warmup()` one step variant at a time (those of `first` token counts first) until `cap_s` seconds
    have passed; the sampler variants and engine.ready only when every step variant compiled."""
    from netra_jax.ops import sampling

    runner = engine.runner
    shapes = runner.all_shapes()
    wanted = {runner.shape_for(n) for n in first}
    order = sorted(shapes, key=lambda s: (s not in wanted, s.num_tokens, s.prompt_rows))
    t0 = time.perf_counter()
    times = []
    for shape in order:
        if time.perf_counter() - t0 > cap_s:
            break
        t = time.perf_counter()
        runner.warmup_shape(shape)
        times.append(time.perf_counter() - t)
    done = len(times) == len(shapes)
    if done:
        sampling.warm_up(sorted({s.num_seqs for s in shapes}), engine.vocab_size)
        engine.ready = True
    secs = time.perf_counter() - t0
    out = {"complete": done, "step_variants": len(shapes), "compiled": len(times), "seconds": sig(secs)}
    out["compile_s"] = [round(x, 2) for x in times]
    if not done and times:
        out["estimated_full_s"] = sig(secs / len(times) * len(shapes))
    return out


def resolved_backend(configured: str | None, cfg: dict, dtype: str) -> str | None:
    """The kernel "auto" runs for this model on this device (`ops.attention.auto_backend`), else `configured`."""
    from netra_jax.ops import attention

    if configured != "auto":
        return configured
    dev = jax.devices()[0]
    shapes = {"q_heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"]}
    shapes |= {"head_dim": cfg["head_dim"], "page_size": engine_settings.FULL["page_size"]}
    cc = getattr(dev, "compute_capability", None)
    return attention.auto_backend(jax.default_backend(), cc, dtype=dtype, kv_dtype=dtype, **shapes)


def run(sec: Section) -> None:
    from netra_jax import LLM

    path = ensure_model_dir(sec.work, sec.dry)
    cfg = model_config(sec.dry)
    size = engine_settings.sizing(path, sec.target(), sec.dry)
    compiled = carried(sec.target(), "bf16")
    kwargs = engine_settings.llm_kwargs(size, str(compiled) if compiled else None)
    sec.set("engine", kwargs)
    t = time.perf_counter()
    llm = LLM(str(path), **kwargs)
    build = time.perf_counter() - t
    # leave time for the measurements: at most half of what is left (the dry run: a few seconds, so that the
    # capped path runs too); a loaded bundle leaves nothing to compile
    cap = 4.0 if sec.dry else max(10.0, 0.5 * sec.left() - 20)
    warm = warm_up(llm.engine, step_sizes(sec, kwargs), cap)
    backend = resolved_backend(llm.engine.runner.backend, cfg, kwargs["dtype"])
    ready = {"build_s": sig(build), "warmup": warm, "attention_backend": backend}
    ready["loaded"] = llm.engine.compiled_report.loaded if llm.engine.compiled_report else 0
    ready["time_to_ready_s"] = sig(build + warm["seconds"]) if warm["complete"] else None
    ready["kv_capacity_tokens"] = llm.engine.kv_capacity_tokens
    ready["weights_gb"] = sig(weight_bytes(cfg) / 1e9)
    sec.set("ready", ready)
    log = CompileLog()
    logger = logging.getLogger("jax._src.dispatch")
    logger.addHandler(log)
    jax.config.update("jax_log_compiles", True)
    try:
        sec.attempt("batch1", {}, functools.partial(batch1, sec, llm, cfg), need_s=5 if sec.dry else 20)
        for users in sec.sizes.profile_users:
            what = {"users": users}
            sec.attempt("profile", what, functools.partial(profile, sec, llm, cfg, users), 5 if sec.dry else 15)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(log)
    steps = [n for n in log.names if n.startswith(("jit(_step", "jit(sample_tokens", "jit(token_logprobs"))]
    sec.set("compiles_after_warmup", {"total": len(log.names), "model_steps": len(steps), "names": log.names[:20]})
    # an RL trainer's swaps on this model: update_params (referenced / host copies) and sleep / wake-up levels 1, 2
    sec.attempt("rl_swap", {}, functools.partial(measure_swaps, llm, 3), need_s=5 if sec.dry else 40)
