"""LoRA adapters through a real `netra-jax serve --enable-lora` process (tiny-llama, the PEFT fixtures of
tests/fixtures/lora) and the official openai client: a request selects an adapter by `model` and gets PEFT's greedy
tokens, /v1/models lists the adapters under the base model, the runtime load / unload routes, errors (unknown model
404, bad adapter 400 while the server keeps serving), and the adapters-in-use gauge."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.checkpoints import DATA, FIXTURES, reference
from support.server import SMALL, ServerProcess, openai_client, running_server, scrape

LORA = DATA / "lora"
MODEL = "tiny-llama"


def _ref(name: str) -> dict:
    return json.loads((LORA / name / "reference.json").read_text())


@pytest.fixture(scope="module")
def server():
    modules = [f"all={LORA / 'llama-all-r8'}", json.dumps({"name": "qv", "path": str(LORA / "llama-qv-r4")})]
    args = (*SMALL, "--enable-lora", "--max-loras", "2", "--lora-modules", *modules, "--allow-runtime-lora-updating")
    with running_server(*args, model=str(FIXTURES / MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _ids(client, model: str, ids: list[int]) -> list[int]:
    out = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return out.choices[0].token_ids


def test_models_lists_the_adapters_under_the_base(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "all", "qv"}
    assert cards["all"].parent == MODEL and cards["all"].root == str(LORA / "llama-all-r8")
    assert getattr(cards[MODEL], "parent", None) is None
    assert client.models.retrieve("qv").parent == MODEL


def test_each_model_answers_as_its_reference(client):
    case = 1
    for model, want in (
        ("all", _ref("llama-all-r8")["cases"][case]["greedy_ids"]),
        ("qv", _ref("llama-qv-r4")["cases"][case]["greedy_ids"]),
        (MODEL, reference(MODEL)["cases"][case]["greedy_ids"][:8]),
    ):
        assert _ids(client, model, _ref("llama-all-r8")["cases"][case]["prompt_ids"]) == want, model


def test_unknown_model_is_a_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'all'" in e.value.body["message"]


def test_load_and_unload_at_runtime(server, client):
    ref = _ref("llama-ko-r2")["cases"][0]
    added = client.post(
        "/load_lora_adapter", body={"lora_name": "ko", "lora_path": str(LORA / "llama-ko-r2")}, cast_to=str
    )
    assert "added successfully" in added
    assert _ids(client, "ko", ref["prompt_ids"]) == ref["greedy_ids"]
    with pytest.raises(openai.BadRequestError) as e:  # a name taken
        client.post("/load_lora_adapter", body={"lora_name": "ko", "lora_path": str(LORA / "llama-qv-r4")}, cast_to=str)
    assert e.value.body["param"] == "lora_name"
    with pytest.raises(openai.BadRequestError) as e:  # an adapter of another model: its shapes are named
        client.post(
            "/load_lora_adapter", body={"lora_name": "q3", "lora_path": str(LORA / "qwen3-all-r8")}, cast_to=str
        )
    assert "do not fit the projection" in e.value.body["message"] and e.value.body["param"] == "lora_path"
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": str(LORA)}, cast_to=str)
    removed = client.post("/unload_lora_adapter", body={"lora_name": "ko"}, cast_to=str)
    assert "removed successfully" in removed
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ko", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "ko"}, cast_to=str)
    assert {m.id for m in client.models.list().data} == {MODEL, "all", "qv"}
    assert _ids(client, "all", ref["prompt_ids"]) == _ref("llama-all-r8")["cases"][0]["greedy_ids"]  # still serving


def test_lora_gauge_names_the_adapters_in_use(server, client):
    m = scrape(server.url)
    info = [k for k in m if k.startswith("netra_lora_requests_info{")]
    assert info == ['netra_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}']


def test_runtime_routes_are_off_without_the_flag_and_bad_modules_stop_the_server():
    with running_server(*SMALL, "--enable-lora", model=str(FIXTURES / MODEL)) as s:
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(LORA / "llama-qv-r4")})
        assert r.status_code == 404
    bad = ServerProcess(
        *SMALL, "--enable-lora", "--lora-modules", f"q3={LORA / 'qwen3-all-r8'}", model=str(FIXTURES / MODEL)
    )
    assert bad.proc.wait(300) == 2
    assert "--lora-modules q3:" in bad.text() and "do not fit the projection" in bad.text()
    nolora = ServerProcess(*SMALL, "--lora-modules", f"a={LORA / 'llama-qv-r4'}", model=str(FIXTURES / MODEL))
    assert nolora.proc.wait(300) == 2 and "need --enable-lora" in nolora.text()


def test_batch_jobs_select_adapters_by_model(tmp_path):
    from netra_jax.engine.factory import build_engine
    from netra_jax.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
    from netra_jax.serving.batch import run_batch
    from netra_jax.serving.lora_modules import parse_lora_modules

    config = EngineConfig(
        model=str(FIXTURES / MODEL),
        dtype="float32",
        cache=CacheConfig(num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        warmup=False,
        lora=LoRAConfig(max_loras=1),
    )
    case = _ref("llama-all-r8")["cases"][1]
    body = {"prompt": case["prompt_ids"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {**body, "model": model}}
        for cid, model in (("a", "all"), ("q", "qv"), ("b", MODEL), ("x", "nope"), ("a2", "all"))
    ]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    modules = parse_lora_modules([f"all={LORA / 'llama-all-r8'}", f"qv={LORA / 'llama-qv-r4'}"])
    engine = build_engine(config)
    run_batch(path, out, engine, progress=False, lora_modules=modules)
    got = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    tokenizer = engine.tokenizer

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    assert got["a"]["response"]["body"]["choices"][0]["text"] == text(case["greedy_ids"])
    assert got["a2"]["response"]["body"]["choices"][0]["text"] == text(case["greedy_ids"])
    assert got["q"]["response"]["body"]["choices"][0]["text"] == text(_ref("llama-qv-r4")["cases"][1]["greedy_ids"])
    base = reference(MODEL)["cases"][1]["greedy_ids"][:8]
    assert got["b"]["response"]["body"]["choices"][0]["text"] == text(base)
    assert got["x"]["response"]["status_code"] == 404
    assert got["x"]["response"]["body"]["error"]["code"] == "model_not_found"
