"""Bucket-aligned chunking: the last prompt chunk admitted to a step is cut so the step ends on a token bucket when
that moves fewer tokens than it saves in padding; the rule itself, the scheduler's use of it, the CPU default."""

from __future__ import annotations

import argparse
import random

import pytest
from test_scheduler import make, reference, run_step

from netra_jax.engine.buckets import bucket_of, fit_chunk, token_buckets
from netra_jax.engine.request import Request
from netra_jax.engine_args import add_engine_args, engine_config
from netra_jax.engine_config import SchedulerConfig
from netra_jax.sampling_params import SamplingParams

B2048 = token_buckets(2048)


def test_token_buckets():
    assert B2048 == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert bucket_of(B2048, 136) == 256 and bucket_of(B2048, 256) == 256 and bucket_of(B2048, 2049) is None


@pytest.mark.parametrize(
    "used, n, then, fitted",
    [
        (8, 128, 8, 120),  # 256 + 16 (the next step's 9 decodes) -> 128 + 16 (8 decodes, 8 prompt tokens)
        (31, 128, 31, 97),  # 256 + 32 -> 128 + 64
        (134, 128, 7, 122),  # 512 + 8 -> 256 + 16
        (7, 121, 7, 121),  # 128: already a bucket
        (0, 130, 0, 130),  # alone in its step: never cut
        (100, 100, 100, 100),  # 256 + 128 either way
        (130, 10, 5, 10),  # the bucket below (128) is under the tokens already there
        (768, 128, 6, 128),  # cutting would leave nothing of it in this step
        (1, 8, 1, 7),  # 16 + 2 -> 8 + 2
        (4, 4, 4, 4),  # 8
        (640, 200, 5, 128),  # 1024 + 8 -> 768 (a 1.5x bucket) + 128
        (1000, 1048, 40, 1048),  # 2048
        (256, 450, 194, 450),  # 768 + 256 (a prefill's last 194 and a decode) = 512 + 512 (both prefills' rest)
    ],
)
def test_fit_chunk(used, n, then, fitted):
    assert fit_chunk(used, n, then, B2048) == fitted


def test_fit_chunk_cuts_only_to_pad_less_over_two_steps():
    rng = random.Random(0)
    for _ in range(2000):
        used, n = rng.randrange(0, 1500), rng.randrange(1, 600)
        then = rng.randrange(0, 300)
        if used + n > 2048:
            continue
        got = fit_chunk(used, n, then, B2048)
        assert 1 <= got <= n
        if got < n:
            assert used > 0 and used + got in B2048
            cut = used + got + bucket_of(B2048, then + n - got)
            kept = bucket_of(B2048, used + n) + bucket_of(B2048, then + 1)
            assert cut < kept


def _decoding(sched, runner, k, prompt_len=5):
    """k requests past their prefill, each decoding one token a step."""
    for i in range(k):
        sched.add_request(Request(f"d{i}", [i + 1] * prompt_len, SamplingParams(max_tokens=50, ignore_eos=True)))
    run_step(sched, runner)
    out, _ = run_step(sched, runner)
    assert [s.num_new_tokens for s in out.scheduled] == [1] * k


def test_a_prompt_joining_decodes_is_cut_to_the_bucket_and_finishes_next_step():
    sched, _, runner = make(num_blocks=256, budget=256, max_seqs=16, max_model_len=256, align_chunks_to_buckets=True)
    _decoding(sched, runner, 8)
    sched.add_request(Request("p", list(range(1, 129)), SamplingParams(max_tokens=3, ignore_eos=True)))
    out, _ = run_step(sched, runner)
    assert out.num_batched_tokens == 128 and [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled][
        -1
    ] == ("p", 120, False)
    out, _ = run_step(sched, runner)
    assert out.num_batched_tokens == 16 and (out.scheduled[-1].request_id, out.scheduled[-1].num_new_tokens) == (
        "p",
        8,
    )
    assert out.scheduled[-1].sample


def test_only_the_steps_last_admission_is_cut():
    sched, _, runner = make(num_blocks=256, budget=512, max_seqs=16, max_model_len=256, align_chunks_to_buckets=True)
    _decoding(sched, runner, 8)
    for k, name in enumerate("pq"):  # (different prompts: q does not wait for p's blocks)
        prompt = [k + 1] + list(range(1, 128))
        sched.add_request(Request(name, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    out, _ = run_step(sched, runner)
    assert [s.num_new_tokens for s in out.scheduled][-2:] == [128, 120] and out.num_batched_tokens == 256


@pytest.mark.parametrize("align", [False, None], ids=["off", "unresolved"])
def test_off_keeps_the_whole_chunk(align):
    sched, _, runner = make(num_blocks=256, budget=256, max_seqs=16, max_model_len=256, align_chunks_to_buckets=align)
    _decoding(sched, runner, 8)
    sched.add_request(Request("p", list(range(1, 129)), SamplingParams(max_tokens=3, ignore_eos=True)))
    out, _ = run_step(sched, runner)
    assert out.num_batched_tokens == 136


def _simulate(seed: int, align: bool) -> tuple[int, int]:
    """Requests arrive while others decode (the same arrivals for a given seed); every output must equal the
    stand-in model's and the shadow KV be right at every step. Returns (padded tokens over all steps, steps)."""
    rng = random.Random(seed)
    budget = 96
    sched, pool, runner = make(32, budget, 6, 64, True, align_chunks_to_buckets=align)
    buckets = token_buckets(budget)
    arrivals = [[] for _ in range(40)]
    for i in range(40):
        for k in range(rng.choice([0, 0, 1, 2])):
            prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(2, 40))]
            arrivals[i].append(Request(f"r{i}-{k}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20))))
    live, done, padding, steps = {}, [], 0, 0
    while steps < len(arrivals) or sched.has_unfinished():
        for r in arrivals[steps] if steps < len(arrivals) else ():
            r.sampling_params.ignore_eos = True
            sched.add_request(r)
            live[r.request_id] = r
        out, finished = run_step(sched, runner)
        steps += 1
        assert out.num_batched_tokens <= budget
        padding += bucket_of(buckets, out.num_batched_tokens) - out.num_batched_tokens if out.scheduled else 0
        for r in finished:
            done.append(live.pop(r.request_id))
    assert not live and pool.num_in_use == 0
    for r in done:
        limit = r.num_prompt_tokens + r.sampling_params.max_tokens
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, limit), r.request_id
    return padding, steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_arrivals_pad_less_with_aligned_chunks(seed):
    aligned, plain = _simulate(seed, True), _simulate(seed, False)
    assert aligned[0] < plain[0]


def test_cpu_default_and_flag():
    assert SchedulerConfig().align_chunks_to_buckets is None
    assert SchedulerConfig().for_platform("cpu").align_chunks_to_buckets is True
    assert SchedulerConfig().for_platform("gpu").align_chunks_to_buckets is False
    assert SchedulerConfig(align_chunks_to_buckets=False).for_platform("cpu").align_chunks_to_buckets is False
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).scheduler.align_chunks_to_buckets is None
    off = engine_config(p.parse_args(["--no-align-chunks-to-buckets"]))
    assert off.scheduler.align_chunks_to_buckets is False


def test_token_buckets_from_a_smallest_bucket():
    assert token_buckets(8192, 64) == (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert token_buckets(40, 64) == (40,) and token_buckets(64, 64) == (64,)


def test_a_step_token_limit_chunks_prompts_and_lifting_it_restores_the_budget():
    """While larger step programs compile (engine/warmup.py), steps hold at most the limit: a prompt is chunked to
    it, decodes still run, and the outputs are the unlimited scheduler's."""
    sched, pool, runner = make(budget=64, max_model_len=256)
    prompt = list(range(1, 101))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    req = Request("a", prompt, sp)
    sched.add_request(req)
    sched.limit_step_tokens(16)
    sizes = []
    while sched.has_unfinished():
        out, _ = run_step(sched, runner)
        sizes.append(out.num_batched_tokens)
        if len(sizes) == 3:
            sched.limit_step_tokens(None)
    assert sizes[:3] == [16, 16, 16] and sizes[3] == 52 and max(sizes) <= 64
    assert req.output_token_ids == reference(prompt, sp, len(prompt) + 4)
    with pytest.raises(ValueError):
        sched.limit_step_tokens(0)


def test_held_requests_wait_while_others_are_admitted():
    sched, pool, runner = make(budget=64, max_model_len=256)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    held = Request("held", [5, 6, 7, 8], sp)
    for req in (held, Request("free", [5, 6, 7, 9], sp)):
        sched.add_request(req)
    sched.hold_waiting(lambda req: req.request_id == "held")
    out, _ = run_step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["free"] and sched.num_waiting == 1
    sched.hold_waiting(None)
    out, _ = run_step(sched, runner)
    assert "held" in [s.request_id for s in out.scheduled]
    while sched.has_unfinished():
        run_step(sched, runner)
    assert held.output_token_ids == reference([5, 6, 7, 8], sp, 4 + 2)
