"""Every hook point against transformers' own intermediate tensors: per fixture family, `LLM.run_with_hooks` records
all the points `LLM.hook_points()` lists, compared with tests/fixtures/hook_reference (make_hook_reference.py), and
`forward_dense(..., hooks=)` gives the same values."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES

from netra_jax import LLM, Hooks
from netra_jax.models.transformer import forward_dense

REFS = DATA / "hook_reference"
MODELS = sorted(p.stem for p in REFS.glob("*.npz"))
RTOL = 1e-4
ATOL = 1e-4  # of each reference tensor's scale (its largest magnitude)


def _fixture_dir(name: str):
    """The checkpoint a reference was made from: a shared fixture, or one of this suite's own."""
    return next((d for d in (FIXTURES / name, DATA / name) if (d / "config.json").is_file()), None)


def _reference(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    meta = json.loads((REFS / f"{name}.json").read_text())
    with np.load(REFS / f"{name}.npz") as z:
        return meta, {k: z[k] for k in z.files}


def _fixture_logits(path, case: int) -> np.ndarray:
    """The fixture's own transformers logits of reference case `case` (reference.json, or its reference.npz)."""
    cases = json.loads((path / "reference.json").read_text())["cases"]
    if "logits" in cases[case]:
        return np.asarray(cases[case]["logits"], np.float32)
    with np.load(path / "reference.npz") as z:
        return z[f"logits_{case}"]


def _disagreements(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    """One line per point whose recording differs from the reference (shape, or values beyond the tolerance)."""
    bad = []
    for name, ref in want.items():
        x = np.asarray(got[name], np.float32)
        if x.shape != ref.shape:
            bad.append(f"{name}: shape {x.shape}, reference {ref.shape}")
            continue
        scale = float(np.abs(ref).max())
        err = float(np.abs(x - ref).max())
        if not np.allclose(x, ref, rtol=RTOL, atol=ATOL * scale):
            bad.append(f"{name}: max abs error {err:.3g} (reference scale {scale:.3g})")
    return bad


@pytest.fixture(scope="module", params=MODELS)
def hooked(request):
    """(name, llm, reference meta, reference tensors, the run recording every listed point) for one fixture."""
    name = request.param
    path = _fixture_dir(name)
    if path is None:
        pytest.skip(f"fixture {name} not present")
    meta, ref = _reference(name)
    stale = np.abs(_fixture_logits(path, meta["reference_case"]) - ref["logits"]).max()
    assert stale < 1e-4, f"{REFS / name}.npz is older than the checkpoint: rerun tests/fixtures/make_hook_reference.py"
    llm = LLM(str(path), dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, num_kv_pages=16, warmup=False)
    run = llm.run_with_hooks(meta["prompt_ids"], Hooks(record=list(llm.hook_points())))
    return name, llm, meta, ref, run


def test_hook_points_lists_the_reference_points(hooked):
    """hook_points() names exactly the points transformers has for this model (MoE layers: no mlp_pre/mlp_post),
    with the reference's shapes once T and K are the prompt's length."""
    _, llm, meta, ref, _ = hooked
    points = llm.hook_points()
    assert set(points) == set(ref)
    T = len(meta["prompt_ids"])
    for name, shape in points.items():
        assert tuple(T if d in ("T", "K") else d for d in shape) == ref[name].shape, name


def test_every_point_matches_transformers(hooked):
    _, _, meta, ref, run = hooked
    assert run.token_ids == meta["prompt_ids"]
    assert set(run.activations) == set(ref)
    for name in ("layers.0.pattern", "logits"):
        assert run.activations[name].dtype == np.float32, name
    bad = _disagreements(run.activations, ref)
    assert not bad, "points that differ from transformers:\n" + "\n".join(bad)
    np.testing.assert_allclose(run.logits, ref["logits"], rtol=RTOL, atol=ATOL * np.abs(ref["logits"]).max())


def test_forward_dense_records_the_same_points():
    """forward_dense(..., hooks=) on tiny-llama returns (logits, records) equal to transformers' tensors."""
    name = "tiny-llama"
    if name not in MODELS or _fixture_dir(name) is None:
        pytest.skip(f"fixture {name} not present")
    meta, ref = _reference(name)
    llm = LLM(str(_fixture_dir(name)), dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, warmup=False)
    ids = np.asarray(meta["prompt_ids"], np.int32)
    logits, records = forward_dense(llm.params, llm.model_config, ids, hooks=Hooks(record=list(llm.hook_points())))
    assert set(records) == set(ref)
    bad = _disagreements({k: np.asarray(v) for k, v in records.items()}, ref)
    assert not bad, "points that differ from transformers:\n" + "\n".join(bad)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=RTOL, atol=ATOL * np.abs(ref["logits"]).max())
