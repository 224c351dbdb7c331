"""Warm-up (netra_jax/engine/warmup.py) on a tiny fixture: only the step buckets a configuration can reach are
compiled, every reachable one is (no compile while serving afterwards), progress counts each variant, and compiling
in parallel threads compiles the same programs as one thread."""

from __future__ import annotations

import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES
from support.compiles import recorded_shapes

from netra_jax import LLM, SamplingParams
from netra_jax.engine.runner import ModelRunner
from netra_jax.engine.warmup import engine_variants, ready_shapes, step_label
from netra_jax.loader import load_model
from netra_jax.ops import sampling

MODEL = FIXTURES / "tiny-llama"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PROGRESS = re.compile(r"compiling (step|widen|sampler|logprobs) variant (\d+) of (\d+) \((.+)\)")


class Compiles:
    """Names of the programs XLA compiles (persistent-cache hits included) while the listener is on."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.on = False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, **kw) -> None:
        if self.on and event == COMPILE_EVENT:
            self.names.append(str(kw.get("fun_name")))

    def __enter__(self) -> list[str]:
        self.names, self.on = [], True
        return self.names

    def __exit__(self, *exc) -> None:
        self.on = False


@pytest.fixture(scope="module")
def compiles() -> Compiles:
    return Compiles()


def _llm(**kw) -> LLM:
    """A small engine whose step is capped by its context: two sequences of at most 24 tokens, so no step holds
    more than 48 tokens although the token budget is 128."""
    args = dict(dtype="float32", max_num_seqs=2, max_model_len=24, max_num_batched_tokens=128, page_size=16)
    return LLM(MODEL, **{**args, **kw})


def _workload(llm: LLM) -> None:
    """Random requests (greedy, sampled, filtered, logprobs, prompt logprobs), waves of mixed sizes, and two
    prompts that fill the largest step: 2 x 23 prompt tokens."""
    rng = random.Random(3)
    vocab = llm.model_config.vocab_size
    reqs, params = [], []
    for i in range(24):
        n = rng.randrange(1, 23)
        reqs.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]})
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(1, 24 - n + 1),
                ignore_eos=True,
                temperature=rng.choice([0.0, 0.8]),
                top_k=rng.choice([0, 5]),
                logprobs=rng.choice([None, 2]),
                prompt_logprobs=rng.choice([None, None, 1]),
                seed=i,
            )
        )
    for start in range(0, 24, 6):
        llm.generate(reqs[start : start + 6], params[start : start + 6], use_tqdm=False)
    full = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(23)]} for _ in range(2)]
    llm.generate(full, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    llm.generate(full[:1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)


@pytest.fixture(scope="module")
def warmed(compiles):
    """An engine warmed in parallel threads, the progress lines it reported, and what its warm-up compiled."""
    llm = _llm(warmup=False)
    lines: list[str] = []
    with compiles as names:
        llm.engine.warmup(progress=lines.append, workers=3)
    return llm, lines, names


def test_only_reachable_buckets_are_compiled(warmed):
    llm, _, _ = warmed
    runner = llm.engine.runner
    assert runner.max_step_tokens == 2 * 24  # the context caps the step below the token budget
    assert runner.buckets[-1] == 128
    brute = {runner.shape_for(n, plp) for n in range(1, runner.max_step_tokens + 1) for plp in (False, True)}
    shapes = runner.all_shapes()
    assert set(shapes) == brute and len(shapes) == len(brute)
    assert max(s.num_tokens for s in shapes) == 64  # 48 tokens pad to 64; the 128 bucket is never compiled
    assert all(s.num_tokens != 128 for s in shapes)
    sampled_rows = sorted({s.num_rows for s in shapes})
    assert [v.kind for v in engine_variants(runner, llm.model_config.vocab_size)].count("sampler") == len(
        sampled_rows
    ) * len(sampling.variant_keys())


def test_serving_after_warm_up_compiles_nothing(warmed, compiles):
    llm, _, _ = warmed
    runner = llm.engine.runner
    with recorded_shapes(runner) as used:
        with compiles as names:
            _workload(llm)
        assert names == [], f"compiled after warm-up: {names}"
        # bias and penalty batches run in the covering sampler program, compiled at warm-up
        with compiles as names:
            params = SamplingParams(max_tokens=2, repetition_penalty=1.3, logit_bias={9: 2.0}, seed=1, logprobs=1)
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert names == [], f"compiled after warm-up: {names}"
        # control: the research hook's whole-prompt logits are not part of serving, so the listener sees them compile
        with compiles as control:
            runner.prompt_logits([5, 6, 7])
        assert "jit(_all_logits)" in control
    assert set(used) <= set(runner.all_shapes())
    assert max(s.num_tokens for s in used) == 64  # the largest compiled bucket is reachable, and reached
    assert any(s.prompt_rows for s in used)


def test_progress_counts_every_variant(warmed):
    llm, lines, _ = warmed
    runner = llm.engine.runner
    parsed = [PROGRESS.fullmatch(line) for line in lines]
    assert all(parsed), lines
    by_kind: dict[str, list[tuple[int, int]]] = {}
    for m in parsed:
        by_kind.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3))))
    num_rows = len({s.num_rows for s in runner.all_shapes()})
    expected = {
        "step": len(runner.all_shapes()),
        "widen": num_rows,
        "sampler": num_rows * len(sampling.variant_keys()),
        "logprobs": num_rows * len(sampling.logprob_keys(sampling.variant_keys())),  # plain and covering
    }
    assert {k: len(v) for k, v in by_kind.items()} == expected  # the engine overlaps steps: widenings too
    for kind, seen in by_kind.items():
        assert seen == [(i, expected[kind]) for i in range(1, expected[kind] + 1)]
    assert len(lines) == len(llm.engine.warmup_report.compiled)
    step_labels = [m.group(4) for m in parsed if m.group(1) == "step"]
    ready = [step_label(s) for s in ready_shapes(runner)]  # the ready ones first: 2-token decode, 64-token prompts
    assert step_labels[: len(ready)] == ready and ready[0].startswith("2 tokens") and ready[1].startswith("64 tokens")
    assert step_labels[len(ready)].startswith("64 tokens") and "prompt-logprob" in step_labels[len(ready)]
    assert step_labels[len(ready) + 1] == "1 token, 1 row"  # then the decode buckets below the ready one


def test_parallel_warm_up_compiles_what_one_thread_does(warmed, compiles):
    """Fresh engines (their step and widening programs are new jits) warmed in one thread and in three: the same
    variants, each step and widening compiled exactly once, and a workload afterwards compiles nothing."""
    llm, _, parallel_names = warmed
    serial = _llm(warmup=False)
    with compiles as serial_names:
        serial.engine.warmup(workers=1)
    assert serial.engine.warmup_report.compiled == llm.engine.warmup_report.compiled
    assert serial.engine.warmup_report.workers == 1 and llm.engine.warmup_report.workers == 3
    runner = serial.engine.runner
    own = ("jit(_step)", "jit(_widen_ids)")
    for names in (serial_names, parallel_names):
        assert sorted(n for n in names if n in own) == sorted(
            ["jit(_step)"] * len(runner.all_shapes())
            + ["jit(_widen_ids)"] * len({s.num_rows for s in runner.all_shapes()})
        )
    with compiles as after:
        _workload(serial)
    assert after == []


def test_steps_lower_alike_however_the_parameters_were_placed():
    """Converted parameters come uncommitted, restored ones committed; the runner commits them, so a step lowers to
    the same module (the same persistent-cache key) on a first start and on later ones."""
    cfg, params = load_model(MODEL, "float32", cache=False)
    loose = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)
    placed = jax.device_put(params, jax.devices()[0])
    assert not jax.tree.leaves(loose)[0].committed and jax.tree.leaves(placed)[0].committed
    texts = []
    for p in (loose, placed):
        runner = ModelRunner(
            cfg, p, num_pages=8, page_size=16, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, overlap=True
        )
        texts.append([runner.lower_step(s).as_text() for s in runner.all_shapes()[:2]])
    assert texts[0] == texts[1]


def test_a_failed_background_compile_lifts_the_restriction():
    """A background compile that fails keeps its error and gives up the restriction (`warm_up` then lets steps
    compile on first use), so no request waits for a program that will not come."""
    from netra_jax.engine.warmup import BackgroundCompile, Variant

    def broken():
        raise RuntimeError("cannot lower")

    called: list[str] = []
    bg = BackgroundCompile(
        [Variant("step", "broken", broken, ("step", "broken", False))],
        lambda *a: called.append("install"),
        give_up=lambda: called.append("give up"),
    ).start()
    assert bg.wait(60) and bg.done
    assert isinstance(bg.error, RuntimeError) and called == ["give up"] and bg.pending == 1
