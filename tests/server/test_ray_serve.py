"""The Ray Serve recipe on a local CPU cluster: two replicas of tiny-llama behind one route answer the `openai` client
(completions give transformers' greedy tokens, chat renders the reference prompt and answers as the completion of that
prompt does, streamed or not), a LoRA adapter of lora_modules answers with PEFT's tokens, and both replicas answer.
Skipped without netra-jax[ray]; slow (Ray starts a cluster)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from support.checkpoints import DATA, FIXTURES, reference

ray = pytest.importorskip("ray", exc_type=ImportError)
serve = pytest.importorskip("ray.serve", exc_type=ImportError)
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

from netra_jax.serving.ray_serve import REPLICA_HEADER, build_app  # noqa: E402
from netra_jax.tokenization.tokenizer import Tokenizer  # noqa: E402

MODEL = FIXTURES / "tiny-llama"
LORA = DATA / "lora"
NAME = "tiny-llama"
REF = reference("tiny-llama")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_routed(url: str, timeout: float = 60.0) -> None:
    """serve.run returns once the replicas run; the HTTP proxy may learn the route a moment later."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not routed after {timeout:g}s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def base_url():
    """One Ray instance and one Serve app of two replicas for the module."""
    port = _free_port()
    env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            {
                "model": str(MODEL),
                "served_model_name": NAME,
                "dtype": "float32",
                "max_model_len": "256",
                "max_num_seqs": "8",
                "max_num_batched_tokens": "128",
                "kv_cache_memory": str(4 << 20),
                "warmup": "false",
                "replicas": "2",
                "num_cpus": "1",
                "enable_auto_tool_choice": "true",
                "tool_call_parser": "hermes",
                "enable_lora": "true",
                "lora_modules": f"all={LORA / 'llama-all-r8'}",
            }
        )
        serve.run(app, name="netra", route_prefix="/")
        _wait_routed(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_are_running(base_url):
    [deployment] = serve.status().applications["netra"].deployments.values()
    assert deployment.status == "HEALTHY" and deployment.replica_states == {"RUNNING": 2}


def test_completion_and_chat_from_both_replicas(base_url):
    tok = Tokenizer.load(MODEL)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    case, chat = REF["cases"][1], REF["chat"]  # (a case whose greedy tokens hold no end of sequence)
    n = len(case["greedy_ids"])

    async def complete(prompt, max_tokens):
        raw = await client.completions.with_raw_response.create(
            model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return raw.headers[REPLICA_HEADER], raw.parse()

    async def converse():
        raw = await client.chat.completions.with_raw_response.create(
            model=NAME, messages=chat["messages"], max_tokens=8, temperature=0
        )
        return raw.headers[REPLICA_HEADER], raw.parse()

    async def stream():
        async with client.chat.completions.with_streaming_response.create(
            model=NAME, messages=chat["messages"], max_tokens=8, temperature=0, stream=True
        ) as raw:
            chunks = [c async for c in await raw.parse()]
        return raw.headers[REPLICA_HEADER], "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def round_():
        """Concurrent requests, so that the router spreads them over the replicas."""
        return await asyncio.gather(
            *[complete(case["prompt_ids"], n) for _ in range(4)],
            *[converse() for _ in range(4)],
            complete(chat["prompt_ids"], 8),
        )

    async def main():
        streamed = await stream()
        results = []
        for _ in range(5):  # each round has 9 requests in flight: one replica taking them all is very unlikely
            results += await round_()
            if len({replica for replica, _ in results}) == 2:
                break
        await client.close()
        return streamed, results

    streamed, results = asyncio.run(main())
    replicas = {replica for replica, _ in results}
    assert len(replicas) == 2, replicas
    completions = [r for _, r in results if r.object == "text_completion"]
    chats = [r for _, r in results if r.object == "chat.completion"]
    expected = tok.decode(case["greedy_ids"])
    for r in completions:
        if r.usage.prompt_tokens == len(case["prompt_ids"]):
            assert r.choices[0].text == expected and r.usage.completion_tokens == n
    chat_prompt_answer = {r.choices[0].text for r in completions if r.usage.prompt_tokens == len(chat["prompt_ids"])}
    assert len(chat_prompt_answer) == 1
    for r in chats:
        assert r.model == NAME and r.usage.prompt_tokens == len(chat["prompt_ids"])
        assert r.choices[0].message.role == "assistant"
        assert {r.choices[0].message.content} == chat_prompt_answer
    assert streamed[0] in replicas and {streamed[1]} == chat_prompt_answer


def test_chat_flags_reach_the_replicas(base_url):
    """The recipe's tool-call keys are the server's flags: tools with tool_choice "auto" are served (a server
    without --enable-auto-tool-choice refuses them) and the hermes parser reads the call from the text."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\\n</tool_call>'
    r = client.chat.completions.create(
        model=NAME,
        messages=REF["chat"]["messages"],
        tools=[weather],
        max_tokens=200,  # the call is about 80 tokens of the 512-token vocabulary
        extra_body={"structured_outputs": {"regex": call}},  # the random model's text, forced to one call
    )
    (tool_call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}


def test_lora_modules_reach_every_replica(base_url):
    """`lora_modules`: /v1/models lists the adapter with the base as parent, and a request naming it gets
    transformers + PEFT's greedy tokens from each replica."""
    models = {m["id"]: m for m in httpx.get(f"{base_url}/models", timeout=30).json()["data"]}
    assert models["all"]["parent"] == NAME
    case = json.loads((LORA / "llama-all-r8" / "reference.json").read_text())["cases"][0]
    body = {"model": "all", "prompt": case["prompt_ids"], "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    replicas = set()
    for _ in range(12):
        r = httpx.post(f"{base_url}/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == case["greedy_ids"]
        replicas.add(r.headers[REPLICA_HEADER])
    assert len(replicas) == 2
