"""Scheduler: chunked prefill, mixed batches, prefix hits, preemption by recompute, stops, aborts and rejection.
A fake runner keeps a shadow of every KV block and checks that each step attends to exactly the right tokens."""

import ast
import hashlib
import random
from pathlib import Path

import pytest

from netra_jax.engine.block_pool import BlockPool
from netra_jax.engine.request import Request, RequestStatus
from netra_jax.engine.scheduler import QueueFullError, Scheduler
from netra_jax.engine_config import SchedulerConfig
from netra_jax.sampling_params import SamplingParams

BS = 4
VOCAB = 40
EOS = 0


def model_token(seq) -> int:
    """A deterministic stand-in for the model: the next token depends only on the tokens before it."""
    return hashlib.sha256(repr(list(seq)).encode()).digest()[0] % VOCAB


class ShadowRunner:
    """Writes each scheduled token into a shadow of its block slot, then checks every scheduled sequence sees
    its whole prefix [0, start + n) in its block table, as attention would read it from the KV pages."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.shadow: dict[int, dict[int, int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, out, token_fn=None) -> dict[str, list[int]]:
        bs = self.pool.block_size
        for s in out.scheduled:
            toks = s.request.all_token_ids
            assert s.start == s.request.num_computed_tokens and s.num_new_tokens > 0
            assert s.token_ids == toks[s.start : s.start + s.num_new_tokens]
            for pos in range(s.start, s.start + s.num_new_tokens):
                b = s.block_ids[pos // bs]
                assert self.pool.ref_count(b) == 1, f"write into shared block {b}"
                self.shadow.setdefault(b, {})[pos % bs] = toks[pos]
            self.computed[s.request_id] = self.computed.get(s.request_id, 0) + s.num_new_tokens
        sampled = {}
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            toks = s.request.all_token_ids
            assert s.sample == (end == len(toks))
            got = [self.shadow.get(s.block_ids[p // bs], {}).get(p % bs) for p in range(end)]
            assert got == toks[:end], f"{s.request_id} reads wrong KV"
            if s.sample:
                sampled[s.request_id] = [token_fn(s) if token_fn else model_token(toks[:end])]
        return sampled


def make(num_blocks=64, budget=64, max_seqs=8, max_model_len=128, caching=True, **kw):
    pool = BlockPool(num_blocks, BS, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **kw)
    return Scheduler(cfg, pool, max_model_len), pool, ShadowRunner(pool)


def run_step(sched, runner, token_fn=None):
    out = sched.schedule()
    sched.check_invariant()
    finished = sched.update_from_output(out, runner.step(out, token_fn))
    sched.check_invariant()
    return out, finished


def reference(prompt, sp, limit, eos=(EOS,)):
    toks, out = list(prompt), []
    while True:
        t = model_token(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= sp.min_tokens and ((not sp.ignore_eos and t in eos) or t in sp.stop_token_ids):
            return out
        if len(toks) >= limit:
            return out


def test_chunked_prefill_then_decode():
    sched, pool, runner = make(budget=32, max_model_len=256)
    req = Request("a", list(range(1, 101)), SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(req)
    steps = []
    while sched.has_unfinished():
        out, finished = run_step(sched, runner)
        [s] = out.scheduled
        steps.append((s.start, s.num_new_tokens, s.sample))
        assert out.num_batched_tokens == s.num_new_tokens <= 32
    assert steps == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True), (100, 1, True), (101, 1, True)]
    assert finished == [req] and req.finish_reason == "length" and req.num_output_tokens == 3
    assert pool.num_in_use == 0


def test_mixed_prefill_and_decode_in_one_step():
    sched, _, runner = make(budget=16)
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(a)
    run_step(sched, runner)
    sched.add_request(Request("b", list(range(101, 141)), SamplingParams(max_tokens=2, ignore_eos=True)))
    shapes = []
    for _ in range(3):
        out, _ = run_step(sched, runner)
        shapes.append([(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled])
    assert shapes == [
        [("a", 1, True), ("b", 15, False)],
        [("a", 1, True), ("b", 15, False)],
        [("a", 1, True), ("b", 10, True)],
    ]


def test_max_num_seqs_caps_the_batch():
    sched, _, runner = make(max_seqs=2)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=2 + i, ignore_eos=True)))
    out, _ = run_step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"] and sched.num_waiting == 1
    out, finished = run_step(sched, runner)
    assert [r.request_id for r in finished] == ["r0"]
    out, _ = run_step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["r1", "r2"]


def test_prefix_hit_shares_blocks_with_identical_tokens():
    sched, pool, runner = make()
    shared = [random.Random(1).randrange(1, VOCAB) for _ in range(20)]
    a = Request("a", shared + [5], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(a)
    run_step(sched, runner)  # a's prompt is computed and its 5 full blocks registered
    b = Request("b", shared + [6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(b)
    out, _ = run_step(sched, runner)  # the shadow check proves b's hit blocks hold b's tokens
    sb = next(s for s in out.scheduled if s.request_id == "b")
    assert (sb.start, sb.num_new_tokens) == (20, 2) and b.num_cached_tokens == 20
    assert sb.block_ids[:5] == a.block_ids[:5] and all(pool.ref_count(x) == 2 for x in sb.block_ids[:5])
    assert pool.prefix_hits_tokens == 20 and pool.prefix_queries_tokens == 21 + 22
    while sched.has_unfinished():
        run_step(sched, runner)
    assert pool.num_in_use == 0 and pool.num_cached > 0
    # after both finished, a third request still hits the cached-free blocks
    c = Request("c", shared + [9], SamplingParams(max_tokens=1))
    sched.add_request(c)
    out, _ = run_step(sched, runner)
    assert c.num_cached_tokens == 20 and out.scheduled[0].num_new_tokens == 1


@pytest.mark.parametrize("budget", [64, 16])
def test_siblings_share_the_prompt_computed_once(budget):
    sched, pool, runner = make(budget=budget)
    prompt = [(7 * i) % 31 + 1 for i in range(40)]
    reqs = [Request(f"s{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        run_step(sched, runner)
    assert runner.computed["s0"] == 40 + 2
    for r in reqs[1:]:
        assert r.num_cached_tokens == 36 and runner.computed[r.request_id] == 4 + 2
        assert r.output_token_ids == reqs[0].output_token_ids


def test_preemption_by_recompute_continues_output():
    sched, pool, runner = make(num_blocks=4, caching=False)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = Request("a", list(range(1, 9)), sp), Request("b", list(range(11, 18)), sp)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, runner)
    b_first = list(b.output_token_ids)
    assert pool.num_free_blocks == 0 and len(b_first) == 1
    out, _ = run_step(sched, runner)  # a needs a third block: b, the latest admitted, is preempted
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == b_first and sched.num_waiting == 1
    steps = []
    while sched.has_unfinished():
        out, _ = run_step(sched, runner)
        steps += [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled]
    assert ("b", 0, 8) in steps  # resumed: prompt + the already generated token, recomputed at once
    for r in (a, b):
        assert r.output_token_ids == reference(r.prompt_token_ids, sp, r.num_prompt_tokens + 6)
    assert b.num_preemptions == 1 and sched.num_preemptions == 1 and pool.num_in_use == 0


def test_never_fitting_requests_are_rejected():
    sched, pool, _ = make(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"This model.s maximum context length is 32 tokens\. However, you requested"):
        sched.add_request(Request("a", [1] * 30, SamplingParams(max_tokens=3)))
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens, the cache has 4"):
        sched.add_request(Request("b", [1] * 10, SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="leaves no room to generate"):
        sched.add_request(Request("c", [1] * 17, SamplingParams(max_tokens=None)))
    assert not sched.has_unfinished() and sched.get_request("a") is None
    sched.add_request(Request("ok", [1] * 10, SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("ok", [2], SamplingParams()))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="negative token id"):
        Request("e", [3, -1])


def test_unbounded_max_tokens_stops_at_the_kv_limit():
    sched, pool, runner = make(num_blocks=4, max_model_len=64)
    r = Request("a", [1] * 10, SamplingParams(max_tokens=None, ignore_eos=True))
    sched.add_request(r)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        run_step(sched, runner)
    assert r.finish_reason == "length" and r.num_tokens == 17 and pool.num_in_use == 0


def test_queue_cap():
    sched, _, _ = make(max_waiting=1)
    sched.add_request(Request("a", [1, 2]))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        sched.add_request(Request("b", [1, 2]))


def test_abort_waiting_and_running_frees_blocks():
    sched, pool, runner = make(max_seqs=1)
    sched.add_request(Request("run", [1] * 9, SamplingParams(max_tokens=10)))
    sched.add_request(Request("wait", [2] * 9, SamplingParams(max_tokens=10)))
    out = sched.schedule()
    assert pool.num_in_use == 3
    r = sched.abort_request("run")  # aborted between schedule and update: its result is ignored
    assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort" and r.block_ids == []
    assert pool.num_in_use == 0
    assert sched.update_from_output(out, {}) == [] and r.num_computed_tokens == 0
    w = sched.abort_request("wait")
    assert w.status is RequestStatus.FINISHED_ABORTED and not sched.has_unfinished()
    assert sched.abort_request("wait") is None and sched.abort_request("nope") is None
    assert sched.schedule().finished_ids == ["run", "wait"]
    sched.check_invariant()


def test_finish_request_for_stop_string():
    sched, pool, runner = make()
    sched.add_request(Request("a", [1] * 6, SamplingParams(max_tokens=10, stop=["###"])))
    run_step(sched, runner)
    r = sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "###")
    assert (r.finish_reason, r.stop_reason, r.status) == ("stop", "###", RequestStatus.FINISHED_STOPPED)
    assert pool.num_in_use == 0 and not sched.has_unfinished()
    with pytest.raises(ValueError, match="needs a finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)


def drive(sched, runner, tokens):
    """Run until finished, sampling the given tokens in order."""
    it = iter(tokens)
    while sched.has_unfinished():
        _, finished = run_step(sched, runner, lambda s: next(it))
    return finished


@pytest.mark.parametrize(
    "sp, tokens, n_out, reason, stop_reason",
    [
        (SamplingParams(max_tokens=5), [3, 7, 4, 4, 4], 2, "stop", None),
        (SamplingParams(max_tokens=5, min_tokens=3), [7, 7, 7, 4, 4], 3, "stop", None),
        (SamplingParams(max_tokens=5, ignore_eos=True), [7, 7, 7, 7, 7], 5, "length", None),
        (SamplingParams(max_tokens=5, stop_token_ids=[9]), [3, 9, 4, 4, 4], 2, "stop", 9),
        (SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[7]), [3, 7, 4], 2, "stop", 7),
        (SamplingParams(max_tokens=None), [3] * 20, 12, "length", None),
    ],
)
def test_token_stop_conditions(sp, tokens, n_out, reason, stop_reason):
    sched, pool, runner = make(max_model_len=16)
    r = Request("a", [1, 2, 3, 4], sp, eos_token_ids=[7, 8])
    sched.add_request(r)
    assert drive(sched, runner, tokens) == [r]
    assert r.output_token_ids == tokens[:n_out] and r.all_token_ids == [1, 2, 3, 4] + tokens[:n_out]
    assert (r.finish_reason, r.stop_reason) == (reason, stop_reason)
    assert r.first_token_time is not None and r.finish_time >= r.arrival_time and pool.num_in_use == 0


def test_missing_sampled_token_is_an_error():
    sched, _, _ = make()
    r = Request("a", [1, 2, 3])
    sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        sched.update_from_output(out, {})
    assert r.num_computed_tokens == 0
    sched.check_invariant()


@pytest.mark.parametrize(
    "seed, num_blocks, budget, max_seqs, caching",
    [(0, 16, 24, 6, True), (1, 16, 24, 6, False), (2, 64, 64, 16, True), (3, 12, 8, 4, True), (4, 20, 256, 32, True)],
)
def test_randomized_simulation(seed, num_blocks, budget, max_seqs, caching):
    rng = random.Random(seed)
    max_model_len = 64
    sched, pool, runner = make(num_blocks, budget, max_seqs, max_model_len, caching)
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 24))] for _ in range(3)]
    to_add, live, done, aborted, rejected = 60, {}, {}, set(), 0
    kv_tokens = num_blocks * BS
    for _ in range(5000):
        for _ in range(min(to_add, rng.choice([0, 0, 1, 3]))):
            to_add -= 1
            prompt = rng.choice(bases)[: rng.randrange(1, 30)] + [rng.randrange(1, VOCAB)] * rng.randrange(0, 12)
            mt = rng.choice([None, rng.randrange(1, 30)])
            sp = SamplingParams(
                max_tokens=mt,
                min_tokens=rng.choice([0, 0, 1]) if mt else 0,
                ignore_eos=rng.random() < 0.3,
                stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else [],
            )
            r = Request(f"r{to_add}", prompt, sp, eos_token_ids=EOS)
            fits = len(prompt) + (mt or 1) <= max_model_len and len(prompt) + (mt or 1) - 1 <= kv_tokens
            if not fits:
                with pytest.raises(ValueError):
                    sched.add_request(r)
                rejected += 1
                continue
            sched.add_request(r)
            live[r.request_id] = r
        if live and rng.random() < 0.03:
            rid = rng.choice(sorted(live))
            assert sched.abort_request(rid) is live[rid]
            aborted.add(rid)
            done[rid] = live.pop(rid)
        out, finished = run_step(sched, runner)
        assert out.num_batched_tokens <= budget and len(out.scheduled) <= max_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for r in finished:
            done[r.request_id] = live.pop(r.request_id)
        if not to_add and not sched.has_unfinished():
            break
    else:
        pytest.fail("simulation did not finish")
    assert not live and pool.num_in_use == 0 and sched.num_running == sched.num_waiting == 0
    for rid, r in done.items():
        assert r.is_finished and r.block_ids == []
        limit = min(max_model_len, kv_tokens + 1) if r.sampling_params.max_tokens is None else None
        limit = limit or r.num_prompt_tokens + r.sampling_params.max_tokens
        ref = reference(r.prompt_token_ids, r.sampling_params, limit)
        if rid in aborted:
            assert r.output_token_ids == ref[: r.num_output_tokens]
        else:
            assert r.output_token_ids == ref, rid
    assert len(done) + rejected == 60 and len(done) > 30
    if caching:
        assert pool.prefix_hits_tokens > 0
    if num_blocks <= 16:
        assert sched.num_preemptions > 0


def test_host_modules_import_no_jax():
    root = Path(__file__).resolve().parents[2] / "netra_jax"
    host = ("request.py", "request_queue.py", "block_pool.py", "sched_output.py", "scheduler.py")
    for rel in [f"engine/{m}" for m in host] + ["sampling_params.py"]:
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("jax", "jaxlib", "numpy") for n in names), (rel, names)
