"""Ray Data scale-out of batch jobs on a local CPU cluster: two engine actors give the same output lines as the
single-process run (order aside), and a Ray run resumes a truncated output file. Skipped without netra-jax[ray]."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", exc_type=ImportError)
pytest.importorskip("ray.data", exc_type=ImportError)

from test_batch import CONFIG, make_batch, outcome, read_out  # noqa: E402

from netra_jax.serving.batch import run_batch  # noqa: E402
from netra_jax.serving.batch_ray import run_batch_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_actors_match_single_process_and_resume(cluster, tmp_path):
    lines, expect = make_batch(seed=1)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    single = tmp_path / "single.jsonl"
    run_batch(path, single, engine_config=CONFIG, progress=False)
    ref = {k: outcome(o) for k, o in read_out(single).items()}
    assert set(ref) == set(expect)

    out = tmp_path / "ray.jsonl"
    summary = run_batch_ray(path, out, CONFIG, replicas=2, batch_size=16, progress=False)
    assert (summary.requests, summary.completed + summary.errors, summary.skipped) == (200, 200, 0)
    assert {k: outcome(o) for k, o in read_out(out).items()} == ref

    head = single.read_text().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(head[:150]) + head[150][:40])  # killed mid-write
    summary = run_batch_ray(path, resumed, CONFIG, replicas=2, batch_size=16, progress=False)
    assert (summary.skipped, summary.completed + summary.errors) == (150, 50)
    assert {k: outcome(o) for k, o in read_out(resumed).items()} == ref
