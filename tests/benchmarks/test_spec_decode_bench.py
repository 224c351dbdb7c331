"""benchmarks/spec_decode.py (offline speculative A/B) and the prompt sets it reads (benchmarks/prompts): the files
are what make_prompts.py writes, the comparison finds the first differing token, the summary takes best / best, and a
tiny-model run end to end writes a result whose greedy tokens match."""

from __future__ import annotations

import json

from support.checkpoints import FIXTURES

from benchmarks import spec_decode as sd
from benchmarks.prompts import make_prompts
from netra_jax.bench import datasets as bd


def test_prompt_files_are_current_and_load_as_chat(smollm2_path, capsys):
    assert make_prompts.main(["--check"]) == 0, capsys.readouterr().err
    items = bd.load_jsonl(sd.SETS["grounded"], 30, 99)
    rows = [json.loads(line) for line in sd.SETS["grounded"].read_text().splitlines()]
    assert 16 <= len(rows) <= 32 and len({r["id"] for r in rows}) == len(rows)
    assert [i.max_tokens for i in items[: len(rows)]] == [r["max_tokens"] for r in rows]
    assert all(i.messages and i.messages[-1]["role"] == "user" for i in items)
    assert all(150 <= r["input_tokens"] <= 600 and 64 <= r["max_tokens"] <= 256 for r in rows)
    assert {r["kind"] for r in rows} == {"copy", "summary"}
    assert len(sd.load_set("chat", 3, 10)) == 3 and {r["max_tokens"] for r in sd.load_set("chat", None, 10)} == {10}


def _run(tok_s: float, ids: list[list[int]], accepted: int = 0) -> dict:
    spec = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": accepted, "accepted_per_pos": []}
    tokens = sum(map(len, ids))
    return {
        "seconds": tokens / tok_s,
        "output_tokens": tokens,
        "output_tok_s": tok_s,
        "token_ids": ids,
        "spec_decode": spec | {"acceptance_rate": accepted / 8, "mean_acceptance_length": 1 + accepted / 2},
    }


def test_compare_and_summary():
    rows = [{"id": "a"}, {"id": "b"}]
    same, other = [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6, 7]]
    assert sd.compare(_run(1, same), _run(1, same), rows) == {"identical": True, "differences": []}
    diff = sd.compare(_run(1, same), _run(1, other), rows)
    assert diff == {"identical": False, "differences": [{"id": "b", "first_difference_at": 1, "lengths": [2, 3]}]}
    runs = {"base": [_run(10, same), _run(12, same)], "spec": [_run(30, same, 6), _run(20, same, 6)]}
    p = sd.summarize_point("grounded", 1, rows, runs)
    assert p["base_tok_s"] == 12 and p["spec_tok_s"] == 30 and p["speedup"] == 2.5
    assert p["speedup_median_same_repeat"] == (3.0 + 20 / 12) / 2
    assert p["acceptance_rate"] == 0.75 and p["mean_acceptance_length"] == 4.0 and p["identical"]
    runs["spec"][1] = _run(20, other)
    p = sd.summarize_point("grounded", 1, rows, runs)
    assert not p["identical"] and p["differences"][0]["id"] == "b"
    res = {"date": "2026-01-01T00:00:00", "machine": {"cpu_flags": []}, "points": [p]}
    res["config"] = {"model": "m", "speculative_config": {}, "repeats": 2, "command": "c"}
    row = sd.markdown(res).splitlines()[-1]
    assert row.startswith("| grounded | 1 | 2 | 5 | 12.0 | 30.0 | 2.50x | 75.0% | 4.00 |")
    assert row.endswith("| NO (1 requests differ) |")


def test_tiny_model_run_writes_identical_result(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--model", str(FIXTURES / "tiny-llama"), "--sets", "chat", "--num-prompts", "2", "--max-tokens", "4"]
    argv += ["--batch", "2", "--repeats", "1", "--no-warmup", "--kv-cache-memory", str(8 << 20), "--out", str(out)]
    assert sd.main(argv) == 0
    res = json.loads(out.read_text())
    (p,) = res["points"]
    assert (p["set"], p["batch"], p["requests"], p["output_tokens"]) == ("chat", 2, 2, 8)
    assert p["identical"] and p["base_tok_s"] > 0 and p["spec_tok_s"] > 0
    assert p["spec_decode"]["num_draft_tokens"] >= p["spec_decode"]["num_accepted_tokens"] >= 0
    assert res["config"]["speculative_config"]["method"] == "ngram" and res["machine"]["jax"]
    assert "| chat | 2 | 2 | 8 |" in out.with_suffix(".md").read_text()
