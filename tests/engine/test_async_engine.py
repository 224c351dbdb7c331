"""AsyncEngine: concurrent asyncio generations match the synchronous engine, bad input raises before any output,
abandoning an iterator aborts the request and frees its KV blocks, and a failing step fails every client."""

from __future__ import annotations

import asyncio

import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import SamplingParams
from netra_jax.engine.async_engine import AsyncEngine, EngineDeadError
from netra_jax.engine.factory import build_engine
from netra_jax.engine_config import EngineConfig, SchedulerConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def aengine():
    cfg = EngineConfig(
        model=str(FIXTURES / "tiny-qwen3"),
        dtype="float32",
        warmup=False,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    ae = AsyncEngine(build_engine(cfg))
    yield ae
    ae.shutdown()


async def _collect(ae, prompt, params, rid):
    outs = [o async for o in ae.generate(prompt, params, rid)]
    return outs


def test_concurrent_requests_match_reference(aengine):
    cases = reference("tiny-qwen3")["cases"]

    async def main():
        return await asyncio.gather(
            *[_collect(aengine, {"prompt_token_ids": c["prompt_ids"]}, GREEDY, f"r{i}") for i, c in enumerate(cases)]
        )

    results = asyncio.run(main())
    for outs, case in zip(results, cases, strict=True):
        assert outs[-1].finished
        assert outs[-1].outputs[0].token_ids == case["greedy_ids"]
        assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text


def test_bad_input_raises_and_abandon_aborts(aengine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(aengine, {"prompt_token_ids": [10**6]}, GREEDY, "bad")
        gen = aengine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=400, ignore_eos=True), "x")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.02)
            if aengine.num_unfinished == 0 and aengine.engine.pool.num_in_use == 0:
                break

    asyncio.run(main())
    assert aengine.num_unfinished == 0
    pool = aengine.engine.pool
    assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_total


def test_failing_step_fails_clients():
    cfg = EngineConfig(
        model=str(FIXTURES / "tiny-llama"),
        dtype="float32",
        warmup=False,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
    )
    engine = build_engine(cfg)

    def boom():
        raise RuntimeError("injected step failure")

    engine.step = boom
    ae = AsyncEngine(engine)

    async def main():
        with pytest.raises(EngineDeadError, match="injected"):
            await _collect(ae, {"prompt_token_ids": [1, 2, 3]}, GREEDY, "a")
        with pytest.raises(EngineDeadError):
            await _collect(ae, {"prompt_token_ids": [1, 2, 3]}, GREEDY, "b")

    asyncio.run(main())
    assert not ae.is_alive


def test_outputs_of_a_step_wake_the_loop_once_and_a_failing_sink_starves_no_one(aengine):
    """Three requests decoding together: their outputs reach the event loop in one call per step (not one per
    request), in order, and a sink that raises loses its own outputs only."""
    cases = reference("tiny-qwen3")["cases"][:3]
    got: dict[str, list] = {f"s{i}": [] for i in range(3)}
    wakeups = 0

    def broken(item):
        raise RuntimeError("a consumer bug")

    async def main():
        nonlocal wakeups
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*args, **kw):
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kw)

        loop.call_soon_threadsafe = counted
        try:
            done = asyncio.Event()

            def sink(rid):
                def put(item):
                    got[rid].append(item)
                    if all(v and v[-1].finished for v in got.values()):
                        done.set()

                return put

            await asyncio.gather(
                *[
                    aengine.submit({"prompt_token_ids": c["prompt_ids"]}, GREEDY, rid, sink(rid))
                    for rid, c in zip(got, cases, strict=True)
                ],
                aengine.submit({"prompt_token_ids": cases[0]["prompt_ids"]}, GREEDY, "broken", broken),
            )
            await asyncio.wait_for(done.wait(), 120)
        finally:
            del loop.call_soon_threadsafe

    asyncio.run(main())
    for (_, outs), case in zip(got.items(), cases, strict=True):
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(case["greedy_ids"]) + 1))
        assert outs[-1].outputs[0].token_ids == case["greedy_ids"]
    delivered = sum(len(v) for v in got.values()) + GREEDY.max_tokens  # the broken sink's outputs were handed out too
    assert wakeups < delivered / 2  # 4 admissions plus about one call per step, for 4 outputs per step
