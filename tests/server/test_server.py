"""The OpenAI-compatible server as a real `netra-jax serve` process on tiny-qwen3, driven by the official openai
client: greedy tokens and logprobs against the transformers reference, chat template and usage, streaming equal to
non-streaming, n, seeds, stops, disconnects that free KV blocks, /metrics, and bad requests answered 4xx."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.bad_requests import BAD
from support.checkpoints import reference
from support.server import MODEL, SMALL, log_softmax, metrics_idle, openai_client, running_server, scrape


@pytest.fixture(scope="module")
def server():
    with running_server(*SMALL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


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
        expected = log_softmax(case["logits"][-1], case["greedy_ids"][0])
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
    secs, after = metrics_idle(server.url)  # closing the response closed the connection
    assert secs < 2.0
    assert after["netra_request_aborted_total"] == before["netra_request_aborted_total"] + 1
    assert after["netra_generation_tokens_total"] - before["netra_generation_tokens_total"] < 8 * 480


def test_non_stream_disconnect_aborts_and_frees_kv(server):
    before = scrape(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.4))
    secs, after = metrics_idle(server.url)
    assert secs < 2.0
    assert after["netra_request_aborted_total"] == before["netra_request_aborted_total"] + 1
    assert after["netra_generation_tokens_total"] - before["netra_generation_tokens_total"] < 8 * 480


def test_metrics_parse_and_move(server, client):
    case = reference(MODEL)["cases"][2]
    before = scrape(server.url)
    client.completions.create(
        model=MODEL, prompt=case["prompt_ids"], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    _, after = metrics_idle(server.url)
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


def test_context_length_errors_read_as_openai_and_vllm_word_them(client):
    """litellm raises ContextWindowExceededError (and falls back to a larger model) on this wording."""
    for prompt, max_tokens, asked in (([7] * 600, 1, "600 tokens in the prompt"), ([7] * 500, 100, "600 tokens (500")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        message = e.value.body["message"]
        assert message.startswith(f"This model's maximum context length is 512 tokens. However, you requested {asked}")
        assert e.value.body["code"] == "context_length_exceeded"


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
    metrics_idle(server.url)
