"""Benchmark results record the machine (CPU model, cores, speed flags, jax versions) and the server's speculative
acceptance from /metrics: netra-jax's and llama-server's counter formats, per-pass deltas through a fake server."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Route

# test_serve_bench is in this folder, which pytest puts on sys.path; `fake` is that module's server fixture
from test_serve_bench import Fake, _run, fake, serving  # noqa: F401

from netra_jax.bench import machine, spec_metrics
from netra_jax.bench import plot as bench_plot
from netra_jax.bench import serve as sb

REPO = Path(__file__).resolve().parents[2]

NETRA_METRICS = """# HELP netra_spec_decode_num_drafts_total Verification steps with a draft
# TYPE netra_spec_decode_num_drafts_total counter
netra_spec_decode_num_drafts_total 40.0
netra_spec_decode_num_drafts_created 1.7e+09
netra_spec_decode_num_draft_tokens_total 160.0
netra_spec_decode_num_accepted_tokens_total 100.0
netra_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 35.0
netra_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 30.0
netra_spec_decode_num_accepted_tokens_per_pos_total{position="3"} 15.0
netra_spec_decode_num_accepted_tokens_per_pos_total{position="2"} 20.0
netra_generation_tokens_total 999.0
"""
LLAMA_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
llamacpp:prompt_tokens_total 512
llamacpp:spec_decode_num_draft_tokens_total 30
llamacpp:spec_decode_num_accepted_tokens_total 12
llamacpp:spec_decode_num_drafts_total 10
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4
"""


def test_parse_netra_counters_and_summary():
    c = spec_metrics.parse(NETRA_METRICS)
    assert c == {
        "num_drafts": 40,
        "num_draft_tokens": 160,
        "num_accepted_tokens": 100,
        "accepted_per_pos": [35, 30, 20, 15],
    }
    s = spec_metrics.delta(c, None)
    assert s["acceptance_rate"] == pytest.approx(100 / 160)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 100 / 40)
    assert s["acceptance_per_pos"] == pytest.approx([35 / 40, 30 / 40, 20 / 40, 15 / 40])


def test_parse_llamacpp_counters_and_delta():
    after = spec_metrics.parse(LLAMA_METRICS)
    before = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6, "accepted_per_pos": [5]}
    d = spec_metrics.delta(after, before)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (6, 18, 6)
    assert d["accepted_per_pos"] == [3, 4]  # a position the first reading lacked counts from zero
    assert d["acceptance_rate"] == pytest.approx(6 / 18) and d["mean_acceptance_length"] == pytest.approx(2.0)


def test_no_speculation_counters_is_none():
    assert spec_metrics.parse("netra_generation_tokens_total 5\n# spec_decode_num_drafts 3\n") is None
    assert spec_metrics.delta(None, None) is None
    zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    idle = spec_metrics.delta(zero, None)
    assert idle["acceptance_rate"] is None and idle["mean_acceptance_length"] is None


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
cpu cores\t: 1
flags\t\t: fpu sse2 sse4_2 avx f16c fma avx2 bmi2 sha_ni

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 sse4_2 avx f16c fma avx2 bmi2 sha_ni avx512f
"""


def test_machine_info_reads_the_first_cpu(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = machine.machine_info(path)
    assert info["cpu_model"] == "AMD EPYC 7B13" and info["cpu_vendor"] == "AuthenticAMD"
    assert info["cpu_flags"] == ["avx", "avx2", "f16c", "fma", "sse4_2"] and info["cores_per_socket"] == 1
    assert info["jax"] == metadata.version("jax") and info["jaxlib"] == metadata.version("jaxlib")
    assert info["usable_cpus"] >= 1 and json.loads(json.dumps(info)) == info
    assert "AMD EPYC 7B13" in machine.describe(info) and "(no AVX-512)" in machine.describe(info)
    flags = "sse2 avx2 fma avx512f avx512_bf16 avx512vl amx_tile amx_int8 avx_vnni sha_ni"
    assert machine.speed_flags(flags) == sorted(flags.split()[1:-1])


class SpecFake(Fake):
    """Fake whose /metrics counts 2 drafts of 3 tokens per request served, 4 of them accepted."""

    def app(self):
        app = super().app()

        async def metrics(_):
            n = len(self.requests)
            lines = [  # gauges, as netra-jax's server writes them (no _total suffix)
                f"netra_spec_decode_num_drafts {2 * n}",
                f"netra_spec_decode_num_draft_tokens {6 * n}",
                f"netra_spec_decode_num_accepted_tokens {4 * n}",
                f'netra_spec_decode_num_accepted_tokens_per_pos{{position="0"}} {2 * n}',
            ]
            return PlainTextResponse("\n".join(lines) + "\n")

        app.router.routes.append(Route("/metrics", metrics))
        return app


@pytest.fixture
def spec_fake():
    f = SpecFake()
    f.ttft, f.itl = 0.01, 0.002
    with serving(f):
        yield f


def test_grounded_chat_sweep_records_machine_and_per_pass_acceptance(spec_fake, tmp_path):
    res = _run(
        spec_fake,
        tmp_path,
        "--endpoint",
        "chat",
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(REPO / "benchmarks" / "prompts" / "grounded.jsonl"),
        "--max-concurrency",
        "1,2",
        "--num-prompts",
        "2,4",
        "--output-len",
        "3",
        "--warmup",
        "1",
        "--label",
        "spec",
        "--no-plot",
    )
    assert res["rc"] == 0 and res["machine"]["jax"] == metadata.version("jax") and res["machine"]["cpu_flags"]
    assert len(spec_fake.requests) == 1 + 2 + 4
    assert spec_fake.requests[1]["messages"][0]["role"] == "system"  # the file's messages, sent as they are
    assert {b["max_tokens"] for b in spec_fake.requests} == {3}  # a given --output-len overrides the lines
    for run, n in zip(res["runs"], (2, 4), strict=True):  # each pass counts its own requests only
        spec = run["spec_decode"]
        assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (2 * n, 6 * n, 4 * n)
        assert spec["acceptance_rate"] == pytest.approx(4 / 6) and spec["mean_acceptance_length"] == 3.0
    assert res["spec_decode"]["num_drafts"] == 2 * 6  # the sweep, without the warm-up request
    table = bench_plot.markdown_table([res], ["ours"])
    assert "| draft acceptance | mean acceptance length | failed |" in table
    assert table.splitlines()[2].endswith("| 66.7% | 3.00 | 0 |")


def test_no_metrics_route_leaves_no_spec_fields(fake, tmp_path):  # noqa: F811
    res = _run(fake, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--no-plot")
    assert res["rc"] == 0 and "spec_decode" not in res and "spec_decode" not in res["runs"][0]
    assert "machine" in res and "draft acceptance" not in bench_plot.markdown_table([res], ["x"])


def test_messages_need_the_chat_endpoint(fake, tmp_path):  # noqa: F811
    path = REPO / "benchmarks" / "prompts" / "chat.jsonl"
    with pytest.raises(SystemExit, match="need --endpoint chat"):
        sb.main(["--base-url", fake.url, "--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "1"])
