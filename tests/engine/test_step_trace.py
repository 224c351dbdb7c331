"""The engine's observers (engine/observer.py) and the per-step trace built on them (engine/step_trace.py): events in
order, every dispatched step read once; the trace off unless asked for, on, one line per step whose composition and
bucket match what the scheduler and runner did, outputs unchanged; the summary's arithmetic on hand-made lines."""

from __future__ import annotations

import json
import os

import pytest
from support.checkpoints import FIXTURES

from netra_jax import LLM, SamplingParams
from netra_jax.engine import step_report, step_trace
from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.observer import EngineObserver
from netra_jax.engine.request import Request
from netra_jax.engine.sched_output import ScheduledRequest, SchedulerOutput

MODEL = FIXTURES / "tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((5, 40, 17, 70, 9))]


def test_composition_splits_prompt_and_past_prompt_tokens():
    a = Request("a", list(range(10)))  # mid-prompt chunk: 4 prompt tokens
    b = Request("b", list(range(5)))  # decoding: its token past the prompt
    b.append_output(7)
    c = Request("c", list(range(3)))  # resumed after preemption: 3 prompt tokens, then 2 outputs recomputed
    c.append_output(1)
    c.append_output(2)
    out = SchedulerOutput([ScheduledRequest(a, 4, 2, [], False), ScheduledRequest(b, 1, 5, [], True)])
    out.scheduled.append(ScheduledRequest(c, 5, 0, [], True))
    assert step_trace.composition(out) == {"prefill": 7, "decode": 3, "prefill_seqs": 2, "seqs": 3, "tokens": 10}


def test_off_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv(step_trace.TRACE_ENV, raising=False)
    llm = LLM(MODEL, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.engine.step_trace is None
    assert "step" not in vars(llm.engine)  # the class's own method runs: nothing wraps it


class Recorder(EngineObserver):
    def __init__(self):
        self.events = []

    def step_started(self):
        self.events.append(("started",))

    def dispatched(self, sched, result, running, waiting):
        assert result.batch.shape.num_tokens >= sched.num_batched_tokens and running >= 0 and waiting >= 0
        self.events.append(("dispatched", id(sched)))

    def tokens_read(self, sched, started, wait):
        assert wait >= 0
        self.events.append(("read", id(sched)))

    def step_done(self, wait, has_unfinished):
        assert wait >= 0
        self.events.append(("done", has_unfinished))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_an_observer_sees_every_step_dispatched_then_read_once(monkeypatch, async_scheduling):
    monkeypatch.delenv(step_trace.TRACE_ENV, raising=False)
    llm = LLM(
        MODEL,
        dtype="float32",
        warmup=False,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    rec = Recorder()
    llm.engine.add_observer(rec)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected  # observing changes nothing
    kinds = [e[0] for e in rec.events]
    dispatched = [e[1] for e in rec.events if e[0] == "dispatched"]
    assert len(dispatched) >= len(PROMPTS) and [e[1] for e in rec.events if e[0] == "read"] == dispatched
    depth = 0  # every event inside a step() call: started ... done, never nested
    for kind in kinds:
        depth += {"started": 1, "done": -1}.get(kind, 0)
        assert depth in (0, 1) and (depth == 1 or kind == "done")
    assert depth == 0 and rec.events[-1] == ("done", False)  # the last call left the engine idle
    llm.engine.remove_observer(rec)
    before = len(rec.events)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert len(rec.events) == before


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_trace_records_each_step_as_scheduled(tmp_path, monkeypatch, async_scheduling):
    kw = dict(dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=32)
    monkeypatch.delenv(step_trace.TRACE_ENV, raising=False)
    plain = LLM(MODEL, async_scheduling=async_scheduling, **kw)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(step_trace.TRACE_ENV, str(path))
    llm = LLM(MODEL, async_scheduling=async_scheduling, **kw)
    engine: LLMEngine = llm.engine
    scheduled = []  # (tokens, bucket) of every dispatched step, seen from the runner
    run = engine.runner.run

    def spy(out, *args, **kwargs):
        result = run(out, *args, **kwargs)
        scheduled.append((out.num_batched_tokens, result.batch.shape.num_tokens))
        return result

    engine.runner.run = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine.step_trace.close()

    config, steps = step_report.read_trace(path)
    assert config["buckets"] == list(engine.runner.buckets)
    assert config["max_num_batched_tokens"] == 32
    assert [s["step"] for s in steps] == list(range(len(scheduled)))
    assert [(s["tokens"], s["bucket"]) for s in steps] == scheduled
    for s in steps:
        assert s["prefill"] + s["decode"] == s["tokens"] <= 32
        assert s["padding"] == s["bucket"] - s["tokens"] >= 0
        assert s["seqs"] <= 4 and s["prefill_seqs"] <= s["seqs"]
        assert s["device_ms"] >= 0 and s["wait_ms"] >= 0 and s["call_ms"] >= s["call_host_ms"]
        assert s["call_cpu_ms"] >= s["call_engine_cpu_ms"] >= 0 and s["call_xla_cpu_ms"] >= 0
    assert sum(s["prefill"] for s in steps) == sum(len(p) for p in PROMPTS)
    # each request's first token comes from its prefill; the other 5 are decoded one per step
    assert sum(s["decode"] for s in steps) == len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert steps[0]["period_ms"] is None and all(s["period_ms"] is not None for s in steps[1:])


def test_xla_thread_cpu_reads_only_the_xla_threads(tmp_path):
    def task(tid, name, utime, stime):
        (tmp_path / tid).mkdir()
        fields = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 5]  # state is field 3, utime 14, stime 15
        (tmp_path / tid / "stat").write_text(f"{tid} ({name}) {' '.join(fields)}\n")

    task("1", "python", 500, 500)
    task("2", "tf_XLAEigen", 30, 10)
    task("3", "tf_XLAEigen", 7, 3)
    task("4", "odd) name (x", 900, 900)  # a thread may name itself with parentheses
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert step_trace.xla_cpu_seconds(str(tmp_path)) == pytest.approx(50 * tick)
    assert step_trace.xla_cpu_seconds(str(tmp_path / "missing")) is None


def _line(step, prefill, decode, bucket, period, device=None):
    return {
        "kind": "step",
        "step": step,
        "prefill": prefill,
        "decode": decode,
        "tokens": prefill + decode,
        "bucket": bucket,
        "padding": bucket - prefill - decode,
        "period_ms": period,
        "device_ms": device if period is None else period - 1.0,
        "call_host_ms": 1.0,
        "call_cpu_ms": 10.0,
        "call_engine_cpu_ms": 1.0,
        "call_xla_cpu_ms": 6.0,
    }


def test_summary_weights_step_times_by_decode_tokens(tmp_path):
    lines = [
        _line(0, 128, 0, 128, None, device=100.0),  # first step after idle: no period, its device time counts
        _line(1, 0, 8, 8, 40.0),
        _line(2, 0, 8, 8, 40.0),
        _line(3, 128, 7, 256, 200.0),
        _line(4, 0, 8, 8, 40.0),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"kind": "config", "buckets": [8]}, *lines]) + "\n")
    config, steps = step_report.read_trace(path)
    s = step_report.summarize(steps)
    assert config["buckets"] == [8]
    assert s["steps"] == 5 and s["decode_steps"] == 4 and s["mixed_steps"] == 1
    assert s["total_s"] == pytest.approx(0.42)
    assert s["decode_tokens"] == 31 and s["prefill_tokens"] == 256
    assert s["pure_decode_ms"] == pytest.approx(40.0)
    assert s["mixed_ms"] == pytest.approx(200.0)
    assert s["decode_weighted_ms"] == pytest.approx((3 * 8 * 40 + 7 * 200) / 31)
    assert s["decode_time_in_mixed_steps"] == pytest.approx(7 * 200 / (3 * 8 * 40 + 7 * 200))
    assert s["padding_share"] == pytest.approx(121 / (128 + 3 * 8 + 256))
    assert s["host_share"] == pytest.approx(5 / 420)
    assert s["cpu_ms"] == {"process": 10.0, "xla": 6.0, "engine": 1.0, "other": 3.0}
    by = {(b["bucket"], b["prefill"]): b for b in s["buckets"]}
    assert by[(8, False)]["steps"] == 3 and by[(256, True)]["share_of_time"] == pytest.approx(200 / 420)
    assert by[(128, True)]["mean_ms"] == pytest.approx(100.0)
    assert "| 256 | yes | 1 | 135 |" in step_report.format_summary(s, config)


def test_report_command_reads_a_step_range(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(_line(i, 0, 8, 8, 40.0 + i)) for i in range(6)) + "\n")
    assert step_report.main([str(path), "--steps", "2:4", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["steps"] == 2 and s["pure_decode_ms"] == pytest.approx(42.5)
    with pytest.raises(SystemExit):
        step_report.main([str(path), "--steps", "9:"])
