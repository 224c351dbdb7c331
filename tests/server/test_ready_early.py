"""A real `netra-jax serve --enable-lora` process (tiny-llama, two PEFT adapters) held on its ready programs alone
($NETRA_JAX_BACKGROUND_GATE): once /ready it serves a scripted mix of every feature (greedy and seeded sampling,
logprobs, prompt logprobs, logit bias, penalties, n > 1, structured output, streaming, both adapters' first
requests, prompts longer than the ready buckets) with zero compilations on the request path and the reference
tokens while its steps pad up into the ready buckets; a request for prompt logprobs waits in the queue until its
program compiles; then the background compile finishes, /metrics counts no program pending, and the same requests
give the same answers. Also: `--warmup full` compiles everything before it is ready."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
from support.checkpoints import DATA, FIXTURES, reference
from support.server import SMALL, ServerProcess, scrape

from netra_jax.engine.warmup import BACKGROUND_GATE_ENV

LORA = DATA / "lora"
MODEL = "tiny-llama"
REQUEST_PATH = "netra_xla_compilations_outside_warmup"
DONE = re.compile(r"background compile done: (\d+) programs")


def _ref(name: str) -> dict:
    return json.loads((LORA / name / "reference.json").read_text())


def _completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 6, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    return _completion(url, **body | {"return_token_ids": True})["choices"][0]["token_ids"]


def _mix(url: str) -> list:
    """One request of each feature, each checked for what it must return; the outputs that depend on nothing but
    the weights and the request (greedy, seeded), for comparison between runs."""
    case = reference(MODEL)["cases"][1]
    prompt, want = case["prompt_ids"], case["greedy_ids"]
    assert _ids(url, MODEL, prompt, 8) == want[:8]  # padded up into the ready buckets: the reference tokens
    for name in ("llama-all-r8", "llama-qv-r4"):  # each adapter's first request: its slot written by a program
        ref = _ref(name)["cases"][1]
        assert _ids(url, name.split("-")[1], ref["prompt_ids"], len(ref["greedy_ids"])) == ref["greedy_ids"]
    seen = []
    out = _completion(url, prompt=prompt, temperature=0.8, seed=3, logprobs=3, n=2)
    assert len(out["choices"]) == 2 and all(len(c["logprobs"]["top_logprobs"]) == 6 for c in out["choices"])
    seen.append([c["text"] for c in out["choices"]])
    out = _completion(url, prompt=prompt, temperature=0, logit_bias={"7": 100}, return_token_ids=True)
    assert out["choices"][0]["token_ids"] == [7] * 6
    out = _completion(url, prompt=prompt, temperature=0.7, seed=1, presence_penalty=1.0, repetition_penalty=1.2)
    seen.append(out["choices"][0]["text"])
    out = _completion(url, prompt=prompt, temperature=0, frequency_penalty=0.5, logprobs=2)
    seen.append(out["choices"][0]["text"])
    out = _completion(url, prompt="Give JSON:", max_tokens=24, temperature=0, response_format={"type": "json_object"})
    assert out["choices"][0]["text"].lstrip().startswith("{")
    seen.append(out["choices"][0]["text"])
    long_prompt = (prompt * 40)[:400]  # longer than the ready prompt bucket (256): chunked to it until others compile
    seen.append(_ids(url, MODEL, long_prompt, 4))
    body = {"model": "all", "prompt": prompt, "max_tokens": 5, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen.append("".join(c["choices"][0]["text"] for c in chunks if c["choices"]))
    return seen


def _prompt_logprobs(url: str, prompt: list[int]) -> list:
    out = _completion(url, prompt=prompt, temperature=0, echo=True, logprobs=1, max_tokens=2)
    lps = out["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == len(prompt) + 2  # the prompt's logprobs (the first has none), then 2
    return lps


def test_ready_on_its_first_programs_and_nothing_compiles_on_the_request_path(tmp_path):
    gate = tmp_path / "background may start"
    modules = [f"all={LORA / 'llama-all-r8'}", f"qv={LORA / 'llama-qv-r4'}"]
    engine = ("--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--num-kv-pages", "64")
    args = (*engine, "--enable-lora", "--max-loras", "2", "--lora-modules", *modules)
    server = ServerProcess(*args, model=str(FIXTURES / MODEL), env={BACKGROUND_GATE_ENV: str(gate)})
    try:
        url = server.wait_ready().url
        metrics = scrape(url)
        pending = metrics["netra_programs_pending"]
        assert pending > 0, server.text()  # held: only the ready programs exist
        before = metrics[REQUEST_PATH]
        first = _mix(url)
        metrics = scrape(url)
        assert metrics[REQUEST_PATH] == before, server.text()[-3000:]
        assert metrics["netra_programs_pending"] == pending  # served with the ready programs alone
        # a request for prompt logprobs waits in the queue for its step program, the first compiled after /ready
        prompt = reference(MODEL)["cases"][1]["prompt_ids"]
        held: dict = {}
        waiting = threading.Thread(target=lambda: held.update(lps=_prompt_logprobs(url, prompt)))
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive() and scrape(url)["netra_num_requests_waiting"] == 1
        gate.touch()
        waiting.join(120)
        assert held["lps"] and scrape(url)[REQUEST_PATH] == before
        deadline = time.monotonic() + 300
        while scrape(url)["netra_programs_pending"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert int(server.wait_for(DONE).group(1)) == pending
        assert _mix(url) == first  # every bucket compiled: the same answers, nothing compiled on the request path
        assert _prompt_logprobs(url, prompt) == held["lps"]
        assert scrape(url)[REQUEST_PATH] == before
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.text()[-3000:]


def test_warmup_full_is_ready_with_every_program_compiled():
    server = ServerProcess(*SMALL, "--warmup", "full", model=str(FIXTURES / MODEL)).wait_ready()
    try:
        assert scrape(server.url)["netra_programs_pending"] == 0
        assert "more compiling in the background" not in server.text()
        before = scrape(server.url)[REQUEST_PATH]
        _completion(server.url, prompt=[5, 6, 7], temperature=0, logit_bias={"9": 5}, logprobs=2)
        assert scrape(server.url)[REQUEST_PATH] == before
    finally:
        server.stop()


def test_the_request_path_counter_counts_compiles_outside_the_warm_up_threads():
    """The control of the tests above: a compile in a thread of the warm-up's name is not on the request path, one
    anywhere else is."""
    import threading

    import jax
    import jax.numpy as jnp

    from netra_jax.engine.warmup import COMPILE_THREADS
    from netra_jax.serving.metrics import CompileCounter

    CompileCounter.install()
    count, outside = CompileCounter.count, CompileCounter.outside_warmup
    worker = threading.Thread(target=lambda: jax.jit(lambda x: x * 3 + 1)(jnp.ones(7)), name=f"{COMPILE_THREADS}_0")
    worker.start()
    worker.join()
    assert CompileCounter.count > count and CompileCounter.outside_warmup == outside
    jax.jit(lambda x: x * 5 - 2)(jnp.ones(9))
    assert CompileCounter.outside_warmup > outside


def test_a_server_stopped_while_compiling_in_the_background_exits_cleanly(tmp_path):
    """SIGTERM while programs still compile in the background: the compile stops after its current program and the
    process exits 0 (no compile runs on into the interpreter's exit)."""
    gate = tmp_path / "background may start"
    server = ServerProcess(*SMALL, model=str(FIXTURES / MODEL), env={BACKGROUND_GATE_ENV: str(gate)}).wait_ready()
    assert scrape(server.url)["netra_programs_pending"] > 0
    assert server.stop() == 0, server.text()[-3000:]
    assert "background compile stopped with" in server.text()
