"""Batch jobs (OpenAI Batch JSONL): a 200-line file of valid and invalid requests gives one output line per input
line with errors exactly where expected and greedy outputs equal to the references; resuming after a truncated or
killed run completes the rest without duplicates and with identical results; the CLI runs it end to end."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from support.checkpoints import FIXTURES, REPO, reference

from netra_jax.engine.factory import build_engine
from netra_jax.engine_config import EngineConfig, SchedulerConfig
from netra_jax.serving.batch import load_progress, run_batch, served_model_name

MODEL = FIXTURES / "tiny-llama"
CONFIG = EngineConfig(
    model=str(MODEL),
    dtype="float32",
    warmup=False,
    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128),
)
REF_TOKENS = 8
WORDS = "the cat sat on a mat while dogs ran far away from home under blue skies".split()


def _line(cid, url, body, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra})


def make_batch(n: int = 200, seed: int = 0) -> tuple[list[str], dict]:
    """n request lines and the expected outcome per output key: None (success) or (error code, message part)."""
    rng = random.Random(seed)
    chat, comp = "/v1/chat/completions", "/v1/completions"
    invalid = [  # (line, key, expected code, message part)
        ('{"custom_id": "broken-1", "url": ', None, "invalid_json", "invalid JSON"),
        ("not json at all", None, "invalid_json", "invalid JSON"),
        ("[1, 2, 3]", None, "invalid_request", "a JSON object"),
        (json.dumps({"url": comp, "body": {"prompt": "x"}}), None, "invalid_request", "custom_id"),
        (_line("bad-url", "/v1/embeddings", {"input": "x"}), "bad-url", "invalid_url", "unsupported url"),
        (_line("bad-temp", comp, {"prompt": "hi", "temperature": -0.5}), "bad-temp", "invalid_request", "temperature"),
        (
            _line("bad-topp", chat, {"messages": [{"role": "user", "content": "a"}], "top_p": 0}),
            "bad-topp",
            "invalid_request",
            "top_p",
        ),
        (_line("empty-msgs", chat, {"messages": []}), "empty-msgs", "invalid_request", "messages"),
        (
            _line("bad-model", chat, {"model": "gpt-4o", "messages": [{"role": "user", "content": "a"}]}),
            "bad-model",
            "model_not_found",
            "gpt-4o",
        ),
        (_line("oov", comp, {"prompt": [3, 4, 512], "max_tokens": 2}), "oov", "invalid_request", "outside the vocab"),
        (
            _line("too-long", comp, {"prompt": [5] * 509, "max_tokens": 8}),
            "too-long",
            "context_length_exceeded",
            "context",
        ),
        (
            _line("functions", chat, {"messages": [{"role": "user", "content": "a"}], "functions": []}),
            "functions",
            "invalid_request",
            "unrecognized request argument supplied: functions",
        ),
        (_line("no-body", comp, None), "no-body", "invalid_request", "body"),
        (_line("stream", comp, {"prompt": "a", "stream": True}), "stream", "invalid_request", "stream"),
    ]
    lines: list[str | None] = [None] * n
    expect: dict = {}
    ref_slots = [0, n // 2, n - 1]
    slots = rng.sample([i for i in range(5, n - 5) if i not in ref_slots], len(invalid) + 2)
    for slot, (text, cid, code, msg) in zip(slots, invalid, strict=False):
        lines[slot] = text
        expect[("id", cid) if cid else ("line", slot + 1)] = (code, msg)
    dup_slot = max(slots[len(invalid) :])
    lines[dup_slot] = _line("req-3", comp, {"prompt": "again", "max_tokens": 2})  # req-3 sits at line 4
    expect[("dup", "req-3", dup_slot + 1)] = ("duplicate_custom_id", "appeared earlier")
    refs = reference("tiny-llama")["cases"]
    for k, (slot, case) in enumerate(zip(ref_slots, refs, strict=True)):
        body = {
            "model": "tiny-llama",
            "prompt": case["prompt_ids"],
            "max_tokens": REF_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines[slot] = _line(f"ref-{k}", comp, body)
        expect[("id", f"ref-{k}")] = None
    for i in range(n):
        if lines[i] is not None:
            continue
        cid = f"req-{i}"
        text = " ".join(rng.choices(WORDS, k=rng.randrange(2, 9)))
        mt = rng.randrange(1, 7)
        if i % 3 == 0:
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": mt, "temperature": 0}
            lines[i] = _line(cid, chat, body)
        elif i % 3 == 1:
            lines[i] = _line(cid, comp, {"prompt": text, "max_tokens": mt, "temperature": 0})
        else:
            ids = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 40))]
            lines[i] = _line(cid, comp, {"prompt": ids, "max_tokens": mt, "temperature": 0, "seed": i})
        expect[("id", cid)] = None
    return lines, expect


def out_key(o: dict) -> tuple:
    err = o["error"] or {}
    if o["custom_id"] is None:
        return ("line", err["line"])
    if err.get("code") == "duplicate_custom_id":
        return ("dup", o["custom_id"], err["line"])
    return ("id", o["custom_id"])


def outcome(o: dict):
    """What must not change between runs (ids and timestamps do)."""
    if o["error"]:
        return ("error", o["error"]["code"], o["error"]["message"], (o["response"] or {}).get("status_code"))
    body = o["response"]["body"]
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}  # prefix-cache hits vary
    return (body["object"], body["model"], body["choices"], usage)


def read_out(path) -> dict:
    outs = [json.loads(s) for s in open(path, encoding="utf-8").read().splitlines()]
    keyed = {out_key(o): o for o in outs}
    assert len(keyed) == len(outs), "an output key appears twice"
    return keyed


@pytest.fixture(scope="module")
def engine():
    return build_engine(CONFIG)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    lines, expect = make_batch()
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, expect


@pytest.fixture(scope="module")
def full_run(engine, batch, tmp_path_factory):
    path, _ = batch
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    summary = run_batch(path, out, engine, progress=False)
    return out, summary


def test_batch_outputs_errors_and_references(engine, batch, full_run):
    _, expect = batch
    out, summary = full_run
    outs = read_out(out)
    assert len(out.read_text().splitlines()) == 200
    assert set(outs) == set(expect)
    for key, exp in expect.items():
        o = outs[key]
        if exp is None:
            assert o["error"] is None, (key, o["error"])
            assert o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        else:
            assert o["error"]["code"] == exp[0], (key, o["error"])
            assert exp[1] in o["error"]["message"], (key, o["error"])
    n_err = sum(e is not None for e in expect.values())
    assert (summary.requests, summary.completed, summary.errors, summary.skipped) == (200, 200 - n_err, n_err, 0)
    assert summary.output_tokens == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in outs.values() if o["error"] is None
    )
    tok = engine.tokenizer
    for k, case in enumerate(reference("tiny-llama")["cases"]):
        body = outs[("id", f"ref-{k}")]["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
        n_prompt = len(case["prompt_ids"])
        usage = {"prompt_tokens": n_prompt, "completion_tokens": REF_TOKENS, "total_tokens": n_prompt + REF_TOKENS}
        assert outcome(outs[("id", f"ref-{k}")])[3] == usage
        assert body["choices"][0]["text"] == tok.decode(case["greedy_ids"][:REF_TOKENS])
        assert body["choices"][0]["finish_reason"] == "length"
    chat = next(o["response"]["body"] for k, o in outs.items() if k == ("id", "req-6"))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert not engine.has_unfinished_requests() and engine.pool.num_in_use == 0


def test_resume_after_truncation(engine, batch, full_run, tmp_path):
    path, _ = batch
    full = full_run[0].read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(full[:120]) + full[120][: len(full[120]) // 2])  # a kill mid-write
    summary = run_batch(path, out, engine, progress=False)
    assert (summary.skipped, summary.completed + summary.errors) == (120, 80)
    assert len(out.read_text().splitlines()) == 200
    ref = read_out(full_run[0])
    got = read_out(out)
    assert {k: outcome(o) for k, o in got.items()} == {k: outcome(o) for k, o in ref.items()}
    again = run_batch(path, out, engine, progress=False)  # nothing left to do
    assert (again.skipped, again.completed, again.errors) == (200, 0, 0)
    assert len(out.read_text().splitlines()) == 200


def test_kill_then_resume_with_cli(batch, full_run, tmp_path):
    path, _ = batch
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "netra_jax.cli",
        "batch",
        str(path),
        str(out),
        "--model",
        str(MODEL),
        "--dtype",
        "float32",
        "--no-warmup",
        "--max-num-batched-tokens",
        "128",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([*cmd, "--max-num-seqs", "2", "--max-in-flight", "2"], env=env, cwd=REPO)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 40):
            assert proc.poll() is None, "the batch finished or failed before it could be killed"
            time.sleep(0.02)
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed_at = len(out.read_bytes().splitlines())
    assert 40 <= killed_at < 200
    res = subprocess.run([*cmd, "--max-num-seqs", "16"], env=env, cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    ref = read_out(full_run[0])
    got = read_out(out)
    assert len(out.read_text().splitlines()) == 200
    assert {k: outcome(o) for k, o in got.items()} == {k: outcome(o) for k, o in ref.items()}


def test_queue_cap_backs_off_and_name(tmp_path):
    """A waiting-queue cap below the in-flight window makes the job wait for room, not fail requests."""
    cfg = EngineConfig(
        model=str(MODEL),
        dtype="float32",
        warmup=False,
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=1),
    )
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(_line(f"r{i}", "/v1/completions", {"prompt": [3 + i, 9], "max_tokens": 2}) + "\n" for i in range(8))
    )
    out = tmp_path / "out.jsonl"
    summary = run_batch(path, out, engine_config=cfg, max_in_flight=16, progress=False)
    assert (summary.completed, summary.errors) == (8, 0)
    assert served_model_name(cfg) == "tiny-llama"
    assert served_model_name(EngineConfig(model="/m/SmolLM2.Q4_1.gguf")) == "SmolLM2.Q4_1"
    assert served_model_name(EngineConfig(model="/m/SmolLM2.Q4_1.gguf", served_model_name="sm")) == "sm"
    assert served_model_name(EngineConfig()) == "SmolLM2-135M-Instruct"


def test_load_progress_tolerates_only_a_truncated_tail(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [json.dumps({"custom_id": c, "error": None}) for c in "ab"]
    out.write_text(good[0] + "\n" + good[1])  # complete last line without its newline: kept
    assert load_progress(out).done == {("id", "a"), ("id", "b")}
    assert out.read_text() == good[0] + "\n" + good[1] + "\n"
    out.write_text(good[0] + '\n{"custom_id": "c", "err')
    assert load_progress(out).done == {("id", "a")}
    assert out.read_text() == good[0] + "\n"
    out.write_text("{oops\n" + good[0] + "\n")
    with pytest.raises(ValueError, match="line 1 is corrupt"):
        load_progress(out)


def test_response_format_json_schema_in_batch(engine, tmp_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    lines = [
        _line(
            "good",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "temperature": 0,
                "response_format": rf,
            },
        ),
        _line(
            "bad",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        ),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    run_batch(inp, out, engine)
    res = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    body = res["good"]["response"]["body"]
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] <= 9
    assert res["bad"]["error"] is not None and "response_format" in res["bad"]["error"]["message"]
