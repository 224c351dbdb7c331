"""Prompt logprobs through one real `netra-jax serve` process on tiny-qwen3, with 32-token steps so the reference
prompts (up to 55 tokens) prefill in chunks: completions echo + logprobs (prompt as text or token ids, max_tokens 0
as lm-eval sends it, streamed) against transformers' logits, vLLM's prompt_logprobs on both routes, their bounds as
400s naming the field, GET /tokenizer_info, no compilation after warm-up, and lm-evaluation-harness's
local-completions run end to end with per-choice loglikelihoods equal to transformers' (1e-3)."""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.server import running_server, scrape

from benchmarks import lm_eval_loglikelihood as lm_eval_bench
from netra_jax.serving.render import prompt_text_offsets
from netra_jax.tokenization.tokenizer import Tokenizer

MODEL = "tiny-qwen3"
K = 5  # alternatives asked for
CASES = reference(MODEL)["cases"]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--num-kv-pages", "64") as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def compilations_at_start(server) -> float:
    """XLA compilations on the request path once the server is ready, before this module's first request."""
    return scrape(server.url)["netra_xla_compilations_outside_warmup"]


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict) -> list[dict]:
    """The chunks of a streamed completion (up to [DONE])."""
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)  # [positions, vocab]
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_prompt_part(lps: dict, ids: list[int], want: np.ndarray, k: int = K) -> None:
    """Completions logprobs of an echoed prompt against log_softmax of the reference logits `want`."""
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        row = want[t - 1]
        assert abs(lps["token_logprobs"][t] - row[ids[t]]) < 1e-4
        top = lps["top_logprobs"][t]
        assert len(top) <= k + 1 and abs(max(top.values()) - row.max()) < 1e-4
        assert top[lps["tokens"][t]] >= lps["token_logprobs"][t]  # its own (or a likelier token's of the same text)


def check_offsets(text: str, lps: dict) -> None:
    """Every token's text sits at its text_offset in the choice's text (byte-level tokens of ASCII text)."""
    assert lps["text_offset"][0] == 0
    for tok, off in zip(lps["tokens"], lps["text_offset"], strict=True):
        assert text[off : off + len(tok)] == tok
    assert lps["text_offset"][-1] + len(lps["tokens"][-1]) == len(text)


# ---------------------------------------------------------------------------------------------------- echo
def test_echo_token_id_prompts_as_lm_eval_sends_them(server):
    """A batch of token-id prompts, echo, logprobs and one generated token (lm-eval's loglikelihood request): the
    prompt's logprobs equal transformers' (the 55-token prompt prefilled in two chunks), then the greedy token."""
    body = {"prompt": [c["prompt_ids"] for c in CASES], "echo": True, "logprobs": K, "max_tokens": 1}
    res = post(server, "/v1/completions", body | {"temperature": 0})
    tok = Tokenizer.load(FIXTURES / MODEL)
    assert [c["index"] for c in res["choices"]] == [0, 1, 2]
    for case, choice in zip(CASES, res["choices"], strict=True):
        ids, lps = case["prompt_ids"], choice["logprobs"]
        want = log_softmax(case["logits"])
        assert len(lps["tokens"]) == len(ids) + 1
        check_prompt_part(lps, ids, want)
        greedy = case["greedy_ids"][0]
        assert choice["text"] == case["text"] + tok.decode([greedy])
        assert abs(lps["token_logprobs"][-1] - want[-1, greedy]) < 1e-4
        check_offsets(choice["text"], lps)
    assert res["usage"]["prompt_tokens"] == sum(len(c["prompt_ids"]) for c in CASES)
    assert res["usage"]["completion_tokens"] == len(CASES)


def test_echo_max_tokens_0_returns_the_prompt_alone(server):
    """echo with max_tokens 0 (text prompts): the prompt's text and logprobs only; vLLM generates one token and
    drops it, and usage counts it as vLLM's does."""
    body = {"prompt": [c["text"] for c in CASES], "echo": True, "logprobs": 1, "max_tokens": 0}
    res = post(server, "/v1/completions", body | {"return_token_ids": True})
    for case, choice in zip(CASES, res["choices"], strict=True):
        ids, lps = case["prompt_ids"], choice["logprobs"]
        assert choice["text"] == case["text"] and choice["finish_reason"] == "length"
        assert len(lps["tokens"]) == len(ids) and choice["token_ids"] == []
        check_prompt_part(lps, ids, log_softmax(case["logits"]), k=1)
        check_offsets(choice["text"], lps)
        own = [None] + [choice["prompt_logprobs"][t][str(ids[t])]["logprob"] for t in range(1, len(ids))]
        assert own == lps["token_logprobs"]  # vLLM shows the prompt_logprobs it computed for the echo too
    assert res["usage"]["completion_tokens"] == len(CASES)


def test_echo_with_generation_offsets_continue_after_the_prompt(server):
    case = CASES[0]
    body = {"prompt": case["text"], "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    choice = post(server, "/v1/completions", body | {"return_token_ids": True})["choices"][0]
    lps, n = choice["logprobs"], len(case["prompt_ids"])
    assert choice["token_ids"] == case["greedy_ids"][:4]
    assert len(lps["tokens"]) == n + 4 and lps["text_offset"][n] == len(case["text"])
    check_offsets(choice["text"], lps)


def test_prompt_text_offsets_follow_the_decoded_text():
    """Multi-byte characters split over byte-level tokens start at the token that opens them; a skipped special
    token takes no room."""
    tok = Tokenizer.load(FIXTURES / MODEL)
    text = "héllo wörld ✓ ok"
    ids = [1, *tok.encode(text)]  # <|im_start|> first: special, skipped in the decoded text
    offsets = prompt_text_offsets(tok, ids)
    assert offsets[:2] == [0, 0] and offsets == sorted(offsets)
    for i, off in enumerate(offsets[1:], 1):
        piece = tok.decode([ids[i]])
        if "\ufffd" not in piece:
            assert text[off : off + len(piece)] == piece
        assert tok.decode(ids[1:i]) == text[:off] or "\ufffd" in tok.decode(ids[1:i])


@pytest.mark.parametrize(
    "case, extra",
    [
        (0, {"logprobs": 2, "max_tokens": 0}),
        (0, {"logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
        (2, {"logprobs": 2, "max_tokens": 3, "n": 2, "seed": 7, "ignore_eos": True}),  # a sibling may sample first
        (1, {"max_tokens": 0}),
        (1, {"max_tokens": 2, "temperature": 0, "ignore_eos": True}),
    ],
)
def test_stream_equals_non_stream(server, case, extra):
    body = {"prompt": CASES[case]["text"], "echo": True, **extra}
    whole = post(server, "/v1/completions", body)["choices"]
    chunks = stream(server, body)
    for choice in whole:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["text"].startswith(CASES[case]["text"])  # the echo opens the choice
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        if "logprobs" not in extra:
            assert choice["logprobs"] is None and all(c["logprobs"] is None for c in mine)
            continue
        assert len(mine[0]["logprobs"]["tokens"]) >= len(CASES[case]["prompt_ids"])  # the prompt's logprobs first
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine if c["logprobs"] for x in c["logprobs"][key]] == choice["logprobs"][key]


# ---------------------------------------------------------------------------------------------------- prompt_logprobs
def test_prompt_logprobs_on_both_routes(server):
    case = CASES[2]
    ids, want = case["prompt_ids"], log_softmax(case["logits"])
    choice = post(server, "/v1/completions", {"prompt": ids, "prompt_logprobs": K, "max_tokens": 1})["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) and choice["logprobs"] is None
    for t in range(1, len(ids)):
        row, own = want[t - 1], plp[t][str(ids[t])]
        assert abs(own["logprob"] - row[ids[t]]) < 1e-4
        assert own["rank"] == int((row > row[ids[t]]).sum()) + 1
        assert {int(i) for i in plp[t]} == set(np.argsort(-row)[:K].tolist()) | {ids[t]}
    chat = reference(MODEL)["chat"]
    res = post(server, "/v1/chat/completions", {"messages": chat["messages"], "prompt_logprobs": 2, "max_tokens": 1})
    same = post(server, "/v1/completions", {"prompt": chat["prompt_ids"], "prompt_logprobs": 2, "max_tokens": 1})
    got, ref = res["prompt_logprobs"], same["choices"][0]["prompt_logprobs"]
    assert len(got) == len(chat["prompt_ids"]) and got[0] is None
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[i]["logprob"] - b[i]["logprob"]) < 1e-5 and a[i]["rank"] == b[i]["rank"] for i in a)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": -2}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": -1, "echo": True}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 21}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": -1}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 2, "stream": True},
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, route, body, field):
    field = field or "prompt_logprobs"
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_tokenizer_info_as_vllm_serves_it(server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    cfg = json.loads((FIXTURES / MODEL / "tokenizer_config.json").read_text())
    assert info["eos_token"] == cfg["eos_token"] and info["pad_token"] == cfg["pad_token"]
    assert info["bos_token"] is None and info["tokenizer_class"]
    assert info["chat_template"] == (FIXTURES / MODEL / "chat_template.jinja").read_text()
    assert info["added_tokens_decoder"] == {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>"}
    assert info["model_max_length"] == httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]


# ---------------------------------------------------------------------------------------------------- lm-eval
def test_lm_eval_local_completions_equals_transformers(server):
    """lm-evaluation-harness's local-completions model (remote tokenizer through /tokenizer_info and /tokenize,
    batches of 8 token-id prompts with echo and logprobs) on the local task netra_mc: every choice's loglikelihood
    equals transformers' on the same weights (tests/fixtures/lm_eval/reference-tiny-qwen3.json, make_reference.py)."""
    ref = json.loads((lm_eval_bench.TASK_DIR / f"reference-{MODEL}.json").read_text())
    ours = lm_eval_bench.run_lm_eval(server.url, MODEL)
    cmp = lm_eval_bench.compare(ours, ref)
    assert cmp["choices"] == 160 and cmp["max_abs_diff"] < lm_eval_bench.TOLERANCE, cmp
    assert cmp["accuracy_ours"] == ref["accuracy"] and cmp["argmax_agree"] == cmp["documents"]


# ---------------------------------------------------------------------------------------------------- last
def test_no_compilations_after_warm_up(server, compilations_at_start):
    """Everything this module asked for, and long prompts (60 and 200 tokens: 2 and 7 chunks) with the most
    alternatives, streamed or not, ran on the programs the warm-up compiled: nothing compiled on the request path."""
    rng = random.Random(3)
    for n in (60, 200):
        ids = [rng.randrange(3, 512) for _ in range(n)]
        post(server, "/v1/completions", {"prompt": ids, "prompt_logprobs": 20, "max_tokens": 2, "temperature": 0.7})
        post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 0})
        stream(server, {"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 2, "n": 2, "seed": n})
    post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "repetition_penalty": 1.3})  # covered too
    assert scrape(server.url)["netra_xla_compilations_outside_warmup"] == compilations_at_start
