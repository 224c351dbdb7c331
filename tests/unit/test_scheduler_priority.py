"""Priority scheduling (vLLM's --scheduling-policy priority): admission by (priority, arrival), the lowest-priority
running request preempted when KV runs out, a waiting request of strictly higher priority preempting for room (never
in vain), fcfs unchanged and refusing priorities, no KV block leaked; on a real engine with overlapped steps too."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random

import pytest
from support.checkpoints import FIXTURES, reference
from test_scheduler import EOS, VOCAB, make, run_step
from test_scheduler import reference as expected_tokens

from netra_jax import LLM, SamplingParams
from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.request import Request, RequestStatus
from netra_jax.engine.request_queue import make_waiting_queue
from netra_jax.engine_args import add_engine_args, engine_config
from netra_jax.engine_config import SchedulerConfig

SP = SamplingParams(max_tokens=6, ignore_eos=True)


def prio(**kw):
    return make(scheduling_policy="priority", **kw)


def run_all(sched, runner) -> list[tuple[list[str], list[str]]]:
    """Step until idle; (scheduled ids, preempted ids) of each step."""
    steps = []
    while sched.has_unfinished():
        out, _ = run_step(sched, runner)
        steps.append(([s.request_id for s in out.scheduled], out.preempted_ids))
    return steps


def first_scheduled(steps) -> list[str]:
    order = []
    for scheduled, _ in steps:
        order += [rid for rid in scheduled if rid not in order]
    return order


def model_output(r: Request) -> list[int]:
    """What the deterministic stand-in model generates for `r` run alone."""
    return expected_tokens(r.prompt_token_ids, r.sampling_params, r.num_prompt_tokens + r.sampling_params.max_tokens)


def assert_done(sched, pool, reqs):
    """Every request finished with the deterministic model's tokens and the pool holds nothing."""
    for r in reqs:
        assert r.is_finished and r.block_ids == [] and r.output_token_ids == model_output(r)
    assert pool.num_free_blocks == pool.num_total and sched.num_running == sched.num_waiting == 0
    sched.check_invariant()


def test_admission_by_priority_then_arrival():
    sched, pool, runner = prio(max_seqs=1)
    t = 1000.0
    reqs = [
        Request("low", [1, 2, 3], SP, arrival_time=t, priority=2),
        Request("p0-b", [4, 5], SP, arrival_time=t + 2, priority=0),
        Request("p1", [6], SP, arrival_time=t + 1, priority=1),
        Request("p0-a", [7, 8], SP, arrival_time=t + 1, priority=0),  # added later, arrived earlier
        Request("p0-c", [9], SP, arrival_time=t + 2, priority=0),  # same arrival as p0-b: added after it
        Request("urgent", [3], SP, arrival_time=t + 5, priority=-1),
    ]
    for r in reqs:
        sched.add_request(r)
    assert [r.request_id for r in sched._waiting] == ["urgent", "p0-a", "p0-b", "p0-c", "p1", "low"]
    order = first_scheduled(run_all(sched, runner))
    assert order == ["urgent", "p0-a", "p0-b", "p0-c", "p1", "low"]
    assert sched.num_preemptions == 0
    assert_done(sched, pool, reqs)


def test_fcfs_serves_in_arrival_order_and_refuses_priorities():
    sched, pool, runner = make(max_seqs=1)
    reqs = [Request(f"r{i}", [i + 1], SP, arrival_time=1000.0 - i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    with pytest.raises(ValueError, match="priority scheduling is not enabled.*--scheduling-policy priority"):
        sched.add_request(Request("urgent", [5], SP, priority=-1))
    assert sched.get_request("urgent") is None and sched.num_waiting == 3
    assert first_scheduled(run_all(sched, runner)) == ["r0", "r1", "r2"]  # queue order, as vLLM's FCFS queue
    assert_done(sched, pool, reqs)


@pytest.mark.parametrize("bad", [1.5, "1", True, None])
def test_priority_must_be_an_integer(bad):
    sched, _, _ = prio()
    with pytest.raises(ValueError, match="priority must be an integer"):
        sched.add_request(Request("a", [1, 2], SP, priority=bad))
    assert not sched.has_unfinished()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(scheduling_policy="lifo")  # the config refuses it before a scheduler is built
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_waiting_queue("")


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_victim(policy):
    """Running order L, H1, H2 (L admitted first). When H1 finds no free block, priority preempts L (already
    scheduled in this step: its entry is taken back) while fcfs preempts H2, the most recently admitted."""
    sched, pool, runner = make(num_blocks=4, caching=False, scheduling_policy=policy)
    ranked = policy == "priority"
    lo = Request("L", [1, 2, 3, 4], SP, priority=5 if ranked else 0)
    sched.add_request(lo)
    run_step(sched, runner)
    h1 = Request("H1", [5, 6, 7, 8], SP, priority=0)
    h2 = Request("H2", [9, 10, 11, 12], SP, priority=1 if ranked else 0)
    sched.add_request(h1)
    sched.add_request(h2)
    out, _ = run_step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["L", "H1", "H2"] and pool.num_free_blocks == 0
    out, _ = run_step(sched, runner)
    if ranked:
        assert out.preempted_ids == ["L"] and [s.request_id for s in out.scheduled] == ["H1", "H2"]
        assert out.num_batched_tokens == 2 and lo.status is RequestStatus.PREEMPTED
        assert lo.num_placeholders == 0 and lo.num_inflight_tokens == 0
    else:
        assert out.preempted_ids == ["H2"] and [s.request_id for s in out.scheduled] == ["L", "H1"]
    run_all(sched, runner)  # later H1 and H2 outgrow the pool too: the lower-ranked of the running gives way
    protected = h1 if ranked else lo  # the highest priority / the earliest admitted
    assert protected.num_preemptions == 0 and sched.num_preemptions >= 2
    assert_done(sched, pool, [lo, h1, h2])


@pytest.mark.parametrize(
    "policy, priority, preempts", [("priority", 0, True), ("priority", 1, False), ("fcfs", 0, False)]
)
def test_waiting_request_preempts_only_a_lower_priority(policy, priority, preempts):
    """L (priority 1) holds all but one block; H, needing two, arrives. Only a strictly smaller priority value
    preempts L for H, in the step H arrives; an equal one waits, as does any request under fcfs."""
    sched, pool, runner = make(num_blocks=5, caching=False, scheduling_policy=policy)
    lo = Request("L", list(range(1, 13)), SP, priority=1 if policy == "priority" else 0)
    sched.add_request(lo)
    run_step(sched, runner)
    hi = Request("H", list(range(20, 28)), SP, priority=priority)
    sched.add_request(hi)
    out, _ = run_step(sched, runner)
    if preempts:
        assert out.preempted_ids == ["L"] and [s.request_id for s in out.scheduled] == ["H"]
        assert lo.num_placeholders == 0 and lo.num_inflight_tokens == 0 and lo.block_ids == []
    else:
        assert out.preempted_ids == [] and [s.request_id for s in out.scheduled] == ["L"]
    steps = run_all(sched, runner)
    order = [rid for scheduled, _ in steps for rid in scheduled]
    assert (order.index("H") < order.index("L")) == preempts  # H runs alone first, or L finishes first
    assert sched.num_preemptions == int(preempts)
    assert_done(sched, pool, [lo, hi])


def test_waiting_request_preempts_at_max_num_seqs():
    sched, pool, runner = prio(max_seqs=1)
    lo = Request("L", [1, 2, 3], SP, priority=3)
    sched.add_request(lo)
    run_step(sched, runner)
    hi = Request("H", [4, 5], SP, priority=2)
    sched.add_request(hi)
    out, _ = run_step(sched, runner)
    assert out.preempted_ids == ["L"] and [s.request_id for s in out.scheduled] == ["H"]
    steps = run_all(sched, runner)
    assert first_scheduled(steps) == ["H", "L"] and sched.num_preemptions == 1
    assert_done(sched, pool, [lo, hi])


def test_no_preemption_in_vain():
    """Preempting L (priority 2) would free only its own block (the shared prefix stays with E, priority 0): too
    few for H (priority 1), so nothing is preempted and H waits."""
    sched, pool, runner = prio(num_blocks=5)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    e = Request("E", shared + [15, 16, 17, 18, 19], SP, priority=0)
    sched.add_request(e)
    run_step(sched, runner)
    lo = Request("L", shared + [21], SP, priority=2)
    sched.add_request(lo)
    run_step(sched, runner)
    assert lo.block_ids[:2] == e.block_ids[:2] and pool.num_free_blocks == 0
    hi = Request("H", [30] * 9, SP, priority=1)
    sched.add_request(hi)
    out, _ = run_step(sched, runner)
    assert out.preempted_ids == [] and [s.request_id for s in out.scheduled] == ["E", "L"]
    run_all(sched, runner)
    assert e.num_preemptions == 0
    assert_done(sched, pool, [e, lo, hi])


@pytest.mark.parametrize("seed, num_blocks, budget, max_seqs", [(0, 12, 24, 6), (1, 10, 64, 3), (2, 10, 8, 8)])
def test_randomized_priorities_leak_nothing(seed, num_blocks, budget, max_seqs):
    """Random arrivals, priorities, aborts and prefix sharing: each step keeps the scheduler and pool invariants
    (the shadow runner checks every step reads exactly its tokens' KV), outputs equal the deterministic model's,
    both kinds of preemption happen, and the pool is whole again at the end."""
    rng = random.Random(seed)
    sched, pool, runner = prio(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, max_model_len=48)
    base = [rng.randrange(1, VOCAB) for _ in range(16)]
    to_add, live, done, aborted = 40, {}, [], set()
    by_running = by_waiting = 0  # steps preempting for a running request / for a waiting one
    for _ in range(3000):
        for _ in range(min(to_add, rng.choice([0, 0, 0, 1, 2]))):
            to_add -= 1
            prompt = base[: rng.randrange(1, 16)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 9))]
            sp = SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=rng.random() < 0.5)
            r = Request(f"r{to_add}", prompt, sp, eos_token_ids=EOS, priority=rng.choice([0, 1, 2]))
            sched.add_request(r)
            live[r.request_id] = r
        if live and rng.random() < 0.02:
            rid = rng.choice(sorted(live))
            sched.abort_request(rid)
            aborted.add(rid)
            done.append(live.pop(rid))
        waiting = {r.request_id for r in sched._waiting}
        out, finished = run_step(sched, runner)
        if out.preempted_ids:  # (a preemption for a running request admits no waiting one in that step)
            admitted = any(s.request_id in waiting for s in out.scheduled)
            by_waiting, by_running = by_waiting + admitted, by_running + (not admitted)
        for r in finished:
            done.append(live.pop(r.request_id))
        if not to_add and not sched.has_unfinished():
            break
    else:
        pytest.fail("simulation did not finish")
    assert not live and pool.num_free_blocks == pool.num_total and len(done) == 40
    for r in done:
        ref = model_output(r)
        assert r.output_token_ids == (ref[: r.num_output_tokens] if r.request_id in aborted else ref), r
    assert by_running > 0 and by_waiting > 0


def test_cli_flag_reaches_the_scheduler_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["m"])).scheduler.scheduling_policy == "fcfs"
    cfg = engine_config(p.parse_args(["m", "--scheduling-policy", "priority"]))
    assert cfg.scheduler.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--scheduling-policy", "lifo"])


# ---------------------------------------------------------------------------------------------- a real engine


@pytest.fixture(scope="module")
def llm():
    """A KV cache of 8 pages of 16 tokens for three prompts needing 12: preemptions are certain; steps overlap."""
    return LLM(
        FIXTURES / "tiny-llama",
        dtype="float32",
        warmup=False,
        num_kv_pages=8,
        page_size=16,
        enable_prefix_caching=False,  # (no prompt shares another's pages: the counts below are the prompts')
        max_num_seqs=8,
        max_num_batched_tokens=64,
        scheduling_policy="priority",
        async_scheduling=True,
    )


def test_engine_generates_reference_tokens_under_preemption(llm):
    cases = reference("tiny-llama")["cases"]
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    params = [SamplingParams(max_tokens=len(c["greedy_ids"]), temperature=0, ignore_eos=True) for c in cases]
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[1, 0, 2])
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]
    assert llm.engine.scheduler.num_preemptions > before
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_total and not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_invariant()
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])


def test_engine_waiting_request_preempts_a_running_one_in_flight(llm):
    """Two low-priority requests decode (a step always in flight), then a high-priority one needing more pages than
    are free arrives: the step that admits it preempts the lowest-priority request, whose in-flight token is kept;
    every request still gives transformers' greedy tokens."""
    eng, cases = llm.engine, reference("tiny-llama")["cases"]
    done = {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids

    def add(rid, case, priority):
        sp = SamplingParams(max_tokens=len(case["greedy_ids"]), temperature=0, ignore_eos=True)
        eng.add_request(rid, {"prompt_token_ids": case["prompt_ids"]}, sp, priority=priority)

    add("low", cases[0], 1)
    add("lowest", cases[1], 2)
    lowest, pool = eng.scheduler.get_request("lowest"), eng.pool
    for _ in range(12):  # until the two hold enough pages (when depends on how their prompts were chunked)
        step()
        if pool.num_free_blocks < pool.blocks_needed(len(cases[2]["prompt_ids"])) and lowest.num_placeholders == 1:
            break
    assert pool.num_free_blocks < pool.blocks_needed(len(cases[2]["prompt_ids"])) and lowest.num_placeholders == 1
    before = eng.scheduler.num_preemptions
    add("high", cases[2], 0)
    step()
    assert eng.scheduler.get_request("high").status is RequestStatus.RUNNING
    assert lowest.status is RequestStatus.PREEMPTED and eng.scheduler.num_preemptions == before + 1
    while eng.has_unfinished_requests():
        step()
    assert done == {"low": cases[0]["greedy_ids"], "lowest": cases[1]["greedy_ids"], "high": cases[2]["greedy_ids"]}
    assert pool.num_free_blocks == pool.num_total
    eng.scheduler.check_invariant()


def test_async_engine_passes_priority_and_fcfs_refuses_it(llm):
    eng = llm.engine
    fcfs_cfg = dataclasses.replace(
        eng.config, scheduler=dataclasses.replace(eng.config.scheduler, scheduling_policy="fcfs")
    )
    fcfs = LLMEngine(fcfs_cfg, eng.model_config, eng.runner.params, eng.tokenizer)
    case = reference("tiny-llama")["cases"][1]
    prompt, sp = {"prompt_token_ids": case["prompt_ids"]}, SamplingParams(max_tokens=4, temperature=0)

    async def last(ae, priority):
        outs = [o async for o in ae.generate(prompt, sp, "r", priority=priority)]
        return outs[-1].outputs[0].token_ids

    for engine, priority, error in [(eng, -3, None), (fcfs, 2, "priority scheduling is not enabled")]:
        ae = AsyncEngine(engine)
        try:
            if error is None:
                assert asyncio.run(last(ae, priority)) == case["greedy_ids"][:4]
            else:
                with pytest.raises(ValueError, match=error):
                    asyncio.run(last(ae, priority))
                assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
        finally:
            ae.shutdown()
    assert eng.pool.num_free_blocks == eng.pool.num_total


def test_server_routes_hand_the_request_priority_to_the_engine(llm):
    """A body's priority reaches LLMEngine.add_request from every generation route of the server."""
    import httpx

    from netra_jax.serving.app import create_app

    eng = llm.engine
    seen: list[int] = []
    add_request = eng.add_request

    def spy(*args, priority: int = 0, **kw):
        seen.append(priority)
        return add_request(*args, priority=priority, **kw)

    eng.add_request = spy
    ae = AsyncEngine(eng)
    app = create_app(ae, "tiny-llama", ready=lambda: True)
    user = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 2, "priority": 3},
        "/v1/chat/completions": {"messages": user, "max_tokens": 2, "priority": -2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2, "priority": 5},
    }

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            for path, body in bodies.items():
                r = await http.post(path, json=body)
                assert r.status_code == 200, r.text

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
        del eng.add_request
    assert seen == [3, -2, 5]
    assert eng.pool.num_free_blocks == eng.pool.num_total
