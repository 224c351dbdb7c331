"""netra_jax.bench.serve against a fake OpenAI-compatible SSE server on a loopback port whose tokens leave on a
fixed schedule (TTFT, then one token per ITL): the measured metrics must match those timings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from netra_jax.bench import datasets as bd
from netra_jax.bench import serve as sb


class Fake:
    """Words 'w<id>' are tokens, any other word is token 999; ids that are multiples of 7 decode to 'x x' (two tokens),
    so decode -> encode changes the length and the client must fix it up. Generation: `ttft` s to the first token,
    then one token every `itl` s (absolute schedule)."""

    vocab = 1000

    def __init__(self, not_ready_polls: int = 0):
        self.ttft, self.itl, self.usage = 0.10, 0.02, True
        self.requests: list[dict] = []
        self.not_ready_polls = not_ready_polls  # /ready answers 503 this many times first

    @staticmethod
    def encode(text: str) -> list[int]:
        return [int(w[1:]) if w.startswith("w") and w[1:].isdigit() else 999 for w in text.split()]

    def app(self) -> Starlette:
        async def models(_):
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        async def ready(_):
            self.not_ready_polls -= 1
            print(f"ready poll, {max(0, self.not_ready_polls)} to go", flush=True)
            return JSONResponse(
                {"status": "ready" if self.not_ready_polls < 0 else "compiling"},
                status_code=200 if self.not_ready_polls < 0 else 503,
            )

        async def tokenize(req: Request):
            ids = self.encode((await req.json())["prompt"])
            return JSONResponse({"tokens": ids, "count": len(ids)})

        async def detokenize(req: Request):
            ids = (await req.json())["tokens"]
            if any(not 0 <= i < self.vocab for i in ids):
                return JSONResponse({"error": {"message": "token id out of range"}}, status_code=400)
            return JSONResponse({"prompt": " ".join("x x" if i % 7 == 0 else f"w{i}" for i in ids)})

        async def generate(req: Request):
            body = await req.json()
            self.requests.append(body)
            chat = "messages" in body
            prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
            if "FAIL" in prompt:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            n, t0 = body["max_tokens"], time.perf_counter()

            def chunk(text, finish=None, usage=None):
                if usage:
                    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                c = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                return f"data: {json.dumps({'choices': [c | {'finish_reason': finish}]})}\n\n"

            async def events():
                if chat:
                    yield chunk("")  # the role chunk: no text, must not count as the first token
                for k in range(n):
                    await asyncio.sleep(max(0.0, t0 + self.ttft + k * self.itl - time.perf_counter()))
                    yield chunk(f"t{k} ")
                yield chunk("", "length")
                if self.usage and body.get("stream_options", {}).get("include_usage"):
                    yield chunk(None, usage={"prompt_tokens": len(prompt.split()), "completion_tokens": n})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/ready", ready),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/detokenize", detokenize, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
            ]
        )


@contextlib.contextmanager
def serving(f: Fake):
    """Serve `f` on a free loopback port in a thread; `f.url` is its root while the block runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(f.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    f.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield f
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.fixture(scope="module")
def fake():
    with serving(Fake()) as f:
        yield f


@pytest.fixture
def reset(fake):
    fake.ttft, fake.itl, fake.usage = 0.10, 0.02, True
    fake.requests.clear()
    return fake


def _run(fake, tmp_path, *extra) -> dict:
    rc = sb.main(["--base-url", fake.url + "/v1", "--result-dir", str(tmp_path), "--disable-tqdm", *extra])
    (out,) = tmp_path.glob("*-serve_*.json")
    res = json.loads(out.read_text())
    res["rc"] = rc
    return res


def test_sweep_metrics_match_fake_timings(reset, tmp_path):
    fake = reset
    res = _run(
        fake,
        tmp_path,
        "--max-concurrency",
        "1,4",
        "--num-prompts",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--ignore-eos",
        "--warmup",
        "2",
        "--label",
        "fake",
    )
    assert res["rc"] == 0 and res["config"]["model"] == "fake-model"
    assert res["config"]["text_source"] == "random ids < 1000 via /detokenize"
    assert res["config"]["request_rate"] == ["inf"] and res["runs"][0]["request_rate"] == "inf"  # strict JSON
    assert (tmp_path / f"{res['date'][:10]}-serve_fake.png").stat().st_size > 10_000
    assert len(fake.requests) == 2 + 8 + 8  # the warm-up requests are sent but not counted
    assert all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in fake.requests)
    assert all(len(b["prompt"].split()) == 16 for b in fake.requests)  # decode/encode fixed up to 16 tokens
    e2e = fake.ttft + 5 * fake.itl  # 0.2 s a request
    for run, waves in zip(res["runs"], (8, 2), strict=True):
        assert run["completed"] == 8 and run["failed"] == 0 and run["errors"] == []
        assert run["total_input_tokens"] == 8 * 16 and run["total_output_tokens"] == 8 * 6
        assert run["mean_ttft_ms"] == pytest.approx(100, abs=25) and run["median_ttft_ms"] >= 99
        assert run["mean_tpot_ms"] == pytest.approx(20, abs=4)
        assert run["median_itl_ms"] == pytest.approx(20, abs=4) and run["p99_itl_ms"] < 60
        assert run["mean_e2el_ms"] == pytest.approx(1000 * e2e, abs=30)
        assert run["duration"] == pytest.approx(waves * e2e, rel=0.3)
        assert run["request_throughput"] == pytest.approx(8 / run["duration"])
        assert run["output_throughput"] == pytest.approx(48 / run["duration"])
        assert run["total_token_throughput"] == pytest.approx((48 + 128) / run["duration"])
    assert res["runs"][1]["request_throughput"] > 2.5 * res["runs"][0]["request_throughput"]


def test_chat_shared_prefix_turns_carry_replies(reset, tmp_path):
    fake = reset
    fake.ttft, fake.itl = 0.05, 0.005
    res = _run(
        fake,
        tmp_path,
        "--endpoint",
        "chat",
        "--dataset",
        "shared-prefix",
        "--prefix-len",
        "10",
        "--num-turns",
        "3",
        "--num-prompts",
        "6",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--max-concurrency",
        "2",
    )
    (run,) = res["runs"]
    assert run["completed"] == 6 and run["total_output_tokens"] == 18
    assert run["mean_ttft_ms"] == pytest.approx(50, abs=20)  # the empty role chunk is not the first token
    systems = {b["messages"][0]["content"] for b in fake.requests}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == 10
    assert sorted(len(b["messages"]) for b in fake.requests) == [2, 2, 4, 4, 6, 6]
    for b in fake.requests:
        assert [m["content"] for m in b["messages"][2::2]] == ["t0 t1 t2 "] * (len(b["messages"]) // 2 - 1)


def test_jsonl_failures_and_counting_chunks_without_usage(reset, tmp_path):
    fake = reset
    fake.ttft, fake.itl, fake.usage = 0.02, 0.01, False
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a b c", "max_tokens": 5}\n\n{"prompt": "FAIL"}\n{"prompt": "d e", "max_tokens": 2}\n')
    res = _run(
        fake,
        tmp_path,
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--no-plot",
    )
    (run,) = res["runs"]
    assert res["rc"] == 1 and run["completed"] == 4 and run["failed"] == 2
    assert run["errors"] and run["errors"][0].startswith("HTTP 500")
    assert run["total_output_tokens"] == 2 * 5 + 2 * 2  # text chunks counted: no usage chunk came
    assert run["total_input_tokens"] == 0  # neither usage nor a dataset length
    assert run["mean_tpot_ms"] == pytest.approx(10, abs=4)
    assert not list(tmp_path.glob("*.png"))


def test_poisson_arrivals_pace_the_pass(reset, tmp_path):
    fake = reset
    fake.ttft, fake.itl = 0.01, 0.005
    res = _run(
        fake,
        tmp_path,
        "--request-rate",
        "20",
        "--num-prompts",
        "10",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--seed",
        "3",
        "--no-plot",
    )
    (run,) = res["runs"]
    gaps = np.random.default_rng(3).gamma(1.0, 1 / 20, size=9).sum()  # the last request starts after these
    assert run["completed"] == 10 and run["request_rate"] == 20
    assert gaps + 0.015 <= run["duration"] < gaps + 1.0


def test_plot_several_engines(reset, tmp_path):
    fake = reset
    fake.ttft, fake.itl = 0.01, 0.002
    res = _run(
        fake,
        tmp_path,
        "--max-concurrency",
        "1,2",
        "--num-prompts",
        "4",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--no-plot",
        "--label",
        "a",
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps(res | {"label": "b"}))
    files = [str(next(tmp_path.glob("*-serve_a.json"))), str(other)]
    table = tmp_path / "t" / "compare.md"
    argv = ["--plot", *files, "--label", "ours", "llama.cpp", "--result-dir", str(tmp_path), "--table", str(table)]
    assert sb.main(argv) == 0
    (png,) = tmp_path.glob("*-serve_ours_vs_llama.cpp.png")
    assert png.stat().st_size > 10_000
    lines = table.read_text().splitlines()
    assert lines[0].startswith("| max concurrency | request rate | engine | output tok/s | median TTFT ms")
    order = [row.split(" | ")[:3] for row in lines[2:]]
    assert order == [[f"| {c}", "inf", e] for c in (1, 2) for e in ("ours", "llama.cpp")]  # grouped by concurrency
    tok_s = f"{res['runs'][1]['output_throughput']:.1f}"
    assert lines[4].split(" | ")[3] == tok_s and lines[4].endswith(" | 0 |")


def test_prompts_per_pass_follow_the_sweep(reset, tmp_path):
    fake = reset
    res = _run(
        fake,
        tmp_path,
        "--max-concurrency",
        "1,4",
        "--num-prompts",
        "3,8",
        "--input-len",
        "8",
        "--output-len",
        "2",
        "--label",
        "per-pass",
    )
    assert res["rc"] == 0 and [r["completed"] for r in res["runs"]] == [3, 8] and len(fake.requests) == 11
    args = sb.parse_args(["--max-concurrency", "1,4,16", "--num-prompts", "3,8"])
    with pytest.raises(SystemExit, match="2 values for 3"):
        sb.prompts_per_pass(args)


def test_metric_definitions():
    a = sb.Output(ok=True, ttft=0.1, latency=0.5, itl=[0.1, 0.2, 0.1], output_tokens=5, prompt_len=7)
    b = sb.Output(ok=True, ttft=0.3, latency=0.3, itl=[], output_tokens=1, prompt_tokens=3, prompt_len=9)
    c = sb.Output(ok=False, error="HTTP 429: full")
    m = sb.compute_metrics([a, b, c], 2.0, [50, 99])
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 429: full"])
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10, 6)  # usage wins over the dataset length
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 8.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["p50_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(100)  # only a: (0.5 - 0.1) / 4; one-token requests have no TPOT
    assert m["median_itl_ms"] == pytest.approx(100) and m["p99_itl_ms"] == pytest.approx(198, abs=0.1)
    assert m["mean_e2el_ms"] == pytest.approx(400)
    empty = sb.compute_metrics([c], 1.0, [99])
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None


def test_long_preset_without_tokenizer_routes():
    args = sb.parse_args(["--dataset", "long"])
    items = asyncio.run(bd.build(args, bd.TextMaker(None, "", None), 3, seed=1))
    assert [(len(i.turns[0].split()), i.max_tokens, i.prompt_lens) for i in items] == [(4000, 128, [None])] * 3
    assert items[0].turns != items[1].turns
    assert asyncio.run(bd.build(args, bd.TextMaker(None, "", None), 3, seed=1))[0].turns == items[0].turns
    args = sb.parse_args(["--dataset", "long", "--input-len", "2000"])
    assert len(asyncio.run(bd.build(args, bd.TextMaker(None, "", None), 1, seed=1))[0].turns[0].split()) == 2000


def test_cli_bench_serve_help(capsys):
    from netra_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: netra-jax bench serve") and "--max-concurrency" in out and "--launch" in out


def test_cli_bench_serve_runs_a_sweep(reset, tmp_path, monkeypatch):
    from netra_jax.cli import main

    fake = reset
    fake.ttft, fake.itl = 0.01, 0.002
    monkeypatch.chdir(tmp_path)  # no benchmarks/results here: the default result directory is ./bench-results
    rc = main(
        [
            "--log-level",
            "WARNING",
            "bench",
            "serve",
            "--base-url",
            fake.url,
            "--max-concurrency",
            "1,2",
            "--num-prompts",
            "3",
            "--input-len",
            "5",
            "--output-len",
            "4",
            "--ignore-eos",
            "--label",
            "cli run",
            "--no-plot",
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    (out,) = (tmp_path / "bench-results").glob("*-serve_cli-run.json")
    res = json.loads(out.read_text())
    assert res["label"] == "cli run" and [r["max_concurrency"] for r in res["runs"]] == [1, 2]
    assert all(r["completed"] == 3 and r["total_output_tokens"] == 12 for r in res["runs"])
    assert len(fake.requests) == 6 and all(b["ignore_eos"] is True and b["max_tokens"] == 4 for b in fake.requests)


FAKE_SERVE = """import sys
import uvicorn
from test_serve_bench import Fake

args = sys.argv[1:]
print("argv", args, flush=True)
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
uvicorn.run(Fake(not_ready_polls=2).app(), host=host, port=port, log_level="warning", lifespan="off")
"""


def test_launch_starts_waits_for_ready_and_stops_the_server(tmp_path, monkeypatch, capsys):
    from netra_jax.bench import launch

    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE_SERVE)
    here = str(Path(__file__).resolve().parent)  # test_serve_bench, for the script's import
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setattr(launch, "SERVE_COMMAND", [sys.executable, str(script)])  # in place of `netra-jax`
    log = tmp_path / "server.log"
    rc = sb.main(
        [
            "--launch",
            "--server-args",
            "some/model --dtype float32",
            "--server-log",
            str(log),
            "--max-concurrency",
            "2",
            "--num-prompts",
            "2",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--label",
            "launched",
            "--result-dir",
            str(tmp_path),
            "--no-plot",
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    printed, text = capsys.readouterr().out, log.read_text()
    # every program compiled before /ready: no background compile beside the sweep
    assert "argv ['serve', 'some/model', '--dtype', 'float32', '--warmup', 'full', '--host', '127.0.0.1'," in text
    assert text.count("ready poll") >= 3 and "0 to go" in text  # polled through two 503s
    assert "server ready on http://127.0.0.1:" in printed and "server stopped (exit status" in printed
    (res,) = [json.loads(f.read_text()) for f in tmp_path.glob("*-serve_launched.json")]
    assert res["runs"][0]["completed"] == 2 and res["config"]["server_args"] == "some/model --dtype float32"
    assert res["config"]["base_url"].startswith("http://127.0.0.1:") and res["config"]["launch"] is True


def test_launch_reports_a_server_that_exits(tmp_path, monkeypatch, capsys):
    from netra_jax.bench import launch

    code = "import sys; print('starting'); print('cannot load the model'); sys.exit(2)"
    monkeypatch.setattr(launch, "SERVE_COMMAND", [sys.executable, "-c", code])
    with pytest.raises(SystemExit) as e:  # status 2: the server refused to start; its last line says why
        with launch.launched("missing.gguf", log_path=str(tmp_path / "log")):
            pytest.fail("the block must not run")
    assert e.value.code == 2
    assert (
        capsys.readouterr().err == "netra-jax bench serve: the launched server did not start: cannot load the model\n"
    )
    code = "import sys; print('crashed'); sys.exit(3)"
    monkeypatch.setattr(launch, "SERVE_COMMAND", [sys.executable, "-c", code])
    with pytest.raises(SystemExit, match="exited with status 3:\ncrashed"):
        with launch.launched("missing.gguf", log_path=str(tmp_path / "log3")):
            pytest.fail("the block must not run")


def test_gguf_f32_copy_has_the_dequantized_weights_and_metadata(tmp_path):
    import gguf

    from netra_jax.bench.gguf_f32 import main as gguf_f32_main
    from netra_jax.loader.gguf_loader import GGUFFile

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    src, dst = tmp_path / "m.Q4_1.gguf", tmp_path / "m.F32.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_file_type(3)  # MOSTLY_Q4_1
    writer.add_context_length(128)
    writer.add_token_list(["<s>", "a", "b"])
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    writer.add_tensor("q", gguf.quants.quantize(w, q4_1), raw_dtype=q4_1)  # bytes [4, 2 blocks of 20]
    writer.add_tensor("h", w[0].astype(np.float16))
    writer.add_tensor("f", w[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_f32_main([str(src), str(dst)]) == 0 and not list(tmp_path.glob("*.part"))
    a, b = GGUFFile(src), GGUFFile(dst)
    assert {t.qtype.name for t in a.tensors.values()} == {"Q4_1", "F16", "F32"}
    assert {t.qtype.name for t in b.tensors.values()} == {"F32"}
    for name in ("q", "h", "f"):
        assert np.array_equal(a.tensor(name), b.tensor(name)) and b.tensor(name).shape == a.tensor(name).shape
    assert np.abs(b.tensor("q") - w).max() < 0.5  # really de-quantized, not reinterpreted bytes
    assert b.metadata.pop("general.file_type") == 0 and a.metadata.pop("general.file_type") == 3
    assert b.metadata == a.metadata and b.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "b"]


def test_max_duration_cuts_a_pass_and_counts_what_streamed(reset, tmp_path):
    fake = reset  # a request streams 1 + 49 tokens over 0.1 + 49 x 0.02 s: longer than the pass may take
    res = _run(
        fake,
        tmp_path,
        "--max-concurrency",
        "2",
        "--num-prompts",
        "6",
        "--input-len",
        "4",
        "--output-len",
        "50",
        "--ignore-eos",
        "--max-duration",
        "0.5",
        "--no-plot",
    )
    (run,) = res["runs"]
    assert len(fake.requests) == 2  # the other four were never sent
    assert run["completed"] == 0 and run["cut"] == 2 and run["failed"] == 0 and run["errors"] == []
    assert run["duration"] == pytest.approx(0.5, abs=0.2)
    assert 2 * 10 <= run["total_output_tokens"] <= 2 * 25  # about 1 + 0.4 / 0.02 tokens each by then
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
