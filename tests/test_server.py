"""The OpenAI-compatible server as a real `netra-jax serve` process on tiny-qwen3, driven by the official openai
client: greedy tokens and logprobs against the transformers reference, chat template and usage, streaming equal to
non-streaming, n, seeds, stops, disconnects that free KV blocks, /metrics, and bad requests answered 4xx."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import FIXTURES, reference
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-qwen3"
READY = re.compile(r"ready on (http://[\d.]+:\d+)")
SMALL = ("--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--num-kv-pages", "64")  # a small engine


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(*args: str, model: str | None = str(FIXTURES / MODEL), timeout: float = 300) -> Server:
    """`python -m netra_jax.cli serve MODEL --port 0 ARGS`; returns once it prints its ready line (the URL)."""
    log = Path(tempfile.mkdtemp(prefix="netra-serve-")) / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "netra_jax.cli",
        "serve",
        *([model] if model else []),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(log.read_text(errors="replace"))
        if m:
            return Server(proc, m.group(1), log)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not become ready (rc={proc.poll()}):\n{log.read_text(errors='replace')[-4000:]}")


@contextlib.contextmanager
def running_server(*args: str, **kw) -> Iterator[Server]:
    """start_server's process for the `with` block; stopped at its end, which must be a clean exit (status 0)."""
    s = start_server(*args, **kw)
    try:
        yield s
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


def openai_client(server: Server, timeout: float = 120) -> openai.OpenAI:
    """The official client on `server`, without retries (a failure shows at once)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v"}': value}, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, timeout: float = 5.0) -> tuple[float, dict[str, float]]:
    """Seconds until no request runs or waits and no KV block is referenced, and the metrics then."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        if (
            m["netra_kv_blocks_in_use"] == 0
            and m["netra_num_requests_running"] == 0
            and m["netra_num_requests_waiting"] == 0
            and m["netra_num_requests_unfinished"] == 0
        ):
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {m}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with running_server(*SMALL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _log_softmax(row: list[float], i: int) -> float:
    m = max(row)
    return row[i] - m - math.log(sum(math.exp(x - m) for x in row))


# ---------------------------------------------------------------------------------------------------- behaviour
def test_probes_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).max_model_len == 512
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_greedy_tokens_and_logprobs_match_reference(client):
    """Concurrent token-id prompts: 24 greedy tokens each equal transformers' ids; the first token's logprob
    equals log-softmax of the reference logits."""
    cases = reference(MODEL)["cases"]

    def run(case):
        return client.completions.create(
            model=MODEL,
            prompt=case["prompt_ids"],
            max_tokens=24,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )

    with ThreadPoolExecutor(len(cases)) as ex:
        results = list(ex.map(run, cases))
    for r, case in zip(results, cases, strict=True):
        ch = r.choices[0]
        assert ch.token_ids == case["greedy_ids"]
        assert ch.prompt_token_ids == case["prompt_ids"]
        assert ch.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(case["prompt_ids"]), 24)
        expected = _log_softmax(case["logits"][-1], case["greedy_ids"][0])
        assert abs(ch.logprobs.token_logprobs[0] - expected) < 1e-3
        assert len(ch.logprobs.tokens) == 24


def test_chat_template_usage_and_greedy_text(server, client):
    chat = reference(MODEL)["chat"]
    tok = httpx.post(server.url + "/tokenize", json={"messages": chat["messages"]}).json()
    assert tok["tokens"] == chat["prompt_ids"] and tok["count"] == len(chat["prompt_ids"])
    r = client.chat.completions.create(
        model=MODEL, messages=chat["messages"], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat["prompt_ids"])
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    plain = client.completions.create(
        model=MODEL, prompt=chat["prompt_ids"], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == plain.choices[0].text


def test_streaming_equals_non_streaming(server, client):
    case = reference(MODEL)["cases"][0]  # its greedy tokens include partial UTF-8 bytes
    kw = dict(model=MODEL, prompt=case["prompt_ids"], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24

    messages = reference(MODEL)["chat"]["messages"]
    kw = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert len({c.id for c in chunks}) == 1

    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_logprobs_formats(client):
    case = reference(MODEL)["cases"][1]
    r = client.completions.create(
        model=MODEL,
        prompt=case["prompt_ids"],
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    for i, (tok, val, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert 3 <= len(top) <= 4 and top[tok] == val and val == max(top.values()) and val <= 0
        assert i == 0 or lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])

    chat = reference(MODEL)["chat"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat["messages"],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[0].bytes == e.bytes
    raw = bytes(b for e in content for b in e.bytes)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content


def test_n_and_seed(client):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, n=3, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    c = client.chat.completions.create(seed=8, **kw)
    texts = lambda r: [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa: E731
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert len(set(texts(a))) > 1  # samples of one request differ
    assert a.usage.completion_tokens == 36

    chunks = list(client.chat.completions.create(seed=7, stream=True, **kw))
    streamed = [
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == texts(a)


def test_stop_strings_and_stop_tokens(client):
    case = reference(MODEL)["cases"][1]  # greedy: " it" x 16, then "qu" x 8
    qu = case["greedy_ids"][16]
    kw = dict(model=MODEL, prompt=case["prompt_ids"], max_tokens=24, temperature=0)
    r = client.completions.create(stop=["qu"], **kw)
    assert r.choices[0].text == " it" * 16 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "qu"
    r = client.completions.create(stop="qu", extra_body={"include_stop_str_in_output": True}, **kw)
    assert r.choices[0].text == " it" * 16 + "qu"
    r = client.completions.create(extra_body={"stop_token_ids": [qu], "return_token_ids": True}, **kw)
    assert r.choices[0].token_ids == case["greedy_ids"][:17] and r.choices[0].text == " it" * 16
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == qu
    chunks = list(client.completions.create(stop=["qu"], stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == " it" * 16


def test_echo_batch_prompts_and_tokenize(server, client):
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "The quick fox"], max_tokens=3, n=2, temperature=0, echo=True
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0].startswith("Hello world") and by[3].startswith("The quick fox") and by[0] == by[1]
    counts = [
        httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["count"]
        for p in ("Hello world", "The quick fox")
    ]
    assert r.usage.prompt_tokens == sum(counts) and r.usage.completion_tokens == 12
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back == {"prompt": "Hello there"}


# ---------------------------------------------------------------------------------------------------- disconnects
LONG = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 480, "n": 8, "temperature": 0, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_kv(server):
    before = scrape(server.url)
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip((x for x in lines if x.startswith("data: {")), range(3), strict=False)]
        assert len(got) == 3
        assert scrape(server.url)["netra_kv_blocks_in_use"] > 0  # still generating
    secs, after = wait_idle(server.url)  # closing the response closed the connection
    assert secs < 2.0
    assert after["netra_request_aborted_total"] == before["netra_request_aborted_total"] + 1
    assert after["netra_generation_tokens_total"] - before["netra_generation_tokens_total"] < 8 * 480


def test_non_stream_disconnect_aborts_and_frees_kv(server):
    before = scrape(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.4))
    secs, after = wait_idle(server.url)
    assert secs < 2.0
    assert after["netra_request_aborted_total"] == before["netra_request_aborted_total"] + 1
    assert after["netra_generation_tokens_total"] - before["netra_generation_tokens_total"] < 8 * 480


def test_metrics_parse_and_move(server, client):
    case = reference(MODEL)["cases"][2]
    before = scrape(server.url)
    client.completions.create(
        model=MODEL, prompt=case["prompt_ids"], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    _, after = wait_idle(server.url)
    d = lambda k: after[k] - before.get(k, 0.0)  # noqa: E731
    assert d("netra_prompt_tokens_total") == len(case["prompt_ids"])
    assert d("netra_generation_tokens_total") == 5
    assert d('netra_request_success_total{finished_reason="length"}') == 1
    for h in (
        "netra_time_to_first_token_seconds",
        "netra_time_per_output_token_seconds",
        "netra_e2e_request_latency_seconds",
    ):
        assert d(f"{h}_count") == 1 and d(f"{h}_sum") > 0
    assert after["netra_kv_blocks_total"] == 64 and after["netra_kv_cache_usage_ratio"] == 0
    assert after["netra_prefix_cache_query_tokens"] > 0 and 0 <= after["netra_prefix_cache_hit_rate"] <= 1
    assert after["netra_engine_alive"] == 1


# ---------------------------------------------------------------------------------------------------- bad input
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
C, CC = "/v1/completions", "/v1/chat/completions"
BAD = [  # (method, path, json body or raw bytes, status, param)
    ("POST", C, {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("POST", C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("POST", C, {"prompt": ""}, 400, "prompt"),
    ("POST", C, {"prompt": []}, 400, "prompt"),
    ("POST", C, {"prompt": [100000]}, 400, "prompt"),
    ("POST", C, {"prompt": [5, -1]}, 400, "prompt"),
    ("POST", C, {"prompt": [7] * 600}, 400, "prompt"),
    ("POST", C, {"prompt": [[1, 2], "x"]}, 400, "prompt"),
    ("POST", C, {}, 400, "prompt"),
    ("POST", C, b"{not json", 400, None),
    ("POST", C, b"[1, 2]", 400, None),
    ("POST", C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("POST", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("POST", C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("POST", C, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("POST", C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("POST", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("POST", C, {"prompt": "hi", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("POST", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("POST", C, {"prompt": "hi", "n": 0}, 400, "n"),
    ("POST", C, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("POST", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("POST", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("POST", C, {"prompt": "hi", "echo": True, "logprobs": -1}, 400, "logprobs"),
    ("POST", C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("POST", C, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("POST", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("POST", C, {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options.usage"),
    ("POST", CC, {"messages": []}, 400, "messages"),
    ("POST", CC, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("POST", CC, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("POST", CC, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("POST", CC, {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("POST", CC, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    (
        "POST",
        CC,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    ("POST", CC, {**CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("POST", CC, {**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("POST", CC, {**CHAT, "stream": "yes"}, 400, "stream"),
    ("POST", CC, {**CHAT, "model": "other"}, 404, "model"),
    ("POST", "/tokenize", {}, 400, "prompt"),
    ("POST", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("GET", "/v1/nothing", None, 404, None),
    ("GET", C, None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
]


def test_bad_requests_get_4xx_envelopes(server, client):
    errors_before = sum(v for k, v in scrape(server.url).items() if k.startswith("netra_request_errors_total"))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path, body, status, param in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = http.request(method, path, **kw)
            case = f"{method} {path} {body!r}"
            assert r.status_code == status, f"{case}: {r.status_code} {r.text}"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], case
            assert err["param"] == param, f"{case}: {err}"
    errors = sum(v for k, v in scrape(server.url).items() if k.startswith("netra_request_errors_total"))
    assert errors - errors_before == len(BAD)
    assert httpx.get(server.url + "/health").status_code == 200  # still serving
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_informational_openai_fields_are_accepted_and_ignored(client):
    """The openai client's informational arguments (user and its successor safety_identifier, prompt_cache_key,
    metadata, store, service_tier) are accepted on chat and completions and change nothing."""
    info = dict(
        user="u", safety_identifier="s", prompt_cache_key="k", metadata={"k": "v"}, store=False, service_tier="auto"
    )
    msgs = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    tagged = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, **info)
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    plain = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    tagged = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, extra_body=info)
    assert tagged.choices[0].text == plain.choices[0].text


def test_concurrent_load_then_idle(server, client):
    """Mixed concurrent traffic (streams, n, stops) leaves no request or KV block behind."""

    def one(i: int):
        if i % 2:
            return "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=MODEL, prompt=f"prompt {i}", max_tokens=16, temperature=0.8, seed=i, stream=True
                )
                if c.choices
            )
        return client.completions.create(model=MODEL, prompt=[i + 3] * 5, max_tokens=16, n=2, stop=["e"]).choices

    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(16)))
    assert all(len(o) == 2 for o in outs[0::2])
    wait_idle(server.url)
