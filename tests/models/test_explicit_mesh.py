"""The forward on a tensor-parallel mesh whose "tp" axis is Explicit (`jax.make_mesh(..., axis_types=(Explicit,))`),
parameters and KV cache laid out by `netra_jax.parallel`, on 4 fake CPU devices in a subprocess: a prefill then a
decode step give one device's logits and transformers' (reference.json), with `mesh=` and under `jax.set_mesh`
(with and without `mesh=`), for dense, sliding-window and MoE-with-sinks models, the "cpu"
attention backend and an int8 KV cache; Auto meshes keep working."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.workers import run_device_worker

CASE = 0  # the 29-token prompt: two KV pages, longer than tiny-gemma3's sliding window
PAGE = 16
# (model, tp, axis type, how the mesh reaches the forward, attention backend, KV cache dtype)
RUNS = [
    ("tiny-llama", 2, "explicit", "mesh=", "reference", "float32"),
    ("tiny-llama", 2, "explicit", "set_mesh+mesh=", "reference", "float32"),
    ("tiny-llama", 2, "explicit", "set_mesh", "reference", "float32"),
    ("tiny-llama", 4, "explicit", "mesh=", "reference", "float32"),  # KV heads repeated
    ("tiny-llama", 2, "explicit", "mesh=", "cpu", "float32"),
    ("tiny-llama", 2, "explicit", "mesh=", "reference", "int8"),
    ("tiny-gemma3", 2, "explicit", "set_mesh+mesh=", "reference", "float32"),
    ("tiny-gpt-oss", 2, "explicit", "mesh=", "reference", "float32"),
    ("tiny-gpt-oss", 2, "explicit", "set_mesh", "reference", "float32"),
    ("tiny-llama", 2, "auto", "mesh=", "reference", "float32"),
    ("tiny-llama", 2, "auto", "set_mesh+mesh=", "reference", "float32"),
    ("tiny-gpt-oss", 2, "auto", "set_mesh", "reference", "float32"),
]
IDS = ["-".join(map(str, run)) for run in RUNS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_device_worker(__file__, tmp_path_factory.mktemp("explicit_mesh") / "results.json")


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_logits_match_one_device_and_transformers(results, run):
    got = np.asarray(results["runs"]["-".join(map(str, run))]["logits"])  # [T, vocab]: prefill rows, then decode's
    name, kv_dtype = run[0], run[5]
    one = np.asarray(results["one_device"][f"{name}-{kv_dtype}"])
    np.testing.assert_allclose(got, one, atol=2e-5)
    if kv_dtype == "float32":
        np.testing.assert_allclose(got, np.asarray(reference(name)["cases"][CASE]["logits"]), atol=1e-4)


def test_explicit_results_keep_their_shardings(results):
    """On an Explicit mesh the returned KV pages stay split on their KV heads (the decode step took them as they
    came), and the logits come out split on the vocabulary as the lm_head is."""
    r = results["runs"]["tiny-llama-2-explicit-mesh=-reference-float32"]
    assert r["kv_spec"] == [None, None, "tp", None]
    assert r["logits_spec"] == [None, "tp"]
    assert results["runs"]["tiny-llama-2-explicit-mesh=-reference-int8"]["kv_spec"] == [None, None, "tp", None]


# ------------------------------------------------------------------------------------------ the worker
def _worker(out_path: str) -> None:
    import contextlib
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from netra_jax import parallel
    from netra_jax.config import ModelConfig
    from netra_jax.loader.hf import HFCheckpoint
    from netra_jax.models.transformer import forward, init_kv_cache
    from netra_jax.models.weight_map import hf_to_params
    from netra_jax.ops.attention.paged_batch import build_batch

    assert len(jax.devices()) == 4
    step = jax.jit(forward, static_argnames=("cfg", "backend", "mesh"))

    @functools.cache
    def load(name):
        cfg = ModelConfig.from_hf_dir(FIXTURES / name)
        ck = HFCheckpoint(FIXTURES / name)
        return cfg, hf_to_params(cfg, ck.get, ck.has, np.float32)

    def prefill_then_decode(name, mesh, how, backend, kv_dtype):
        """Logits [T, vocab] of the prompt's first T - 1 tokens in one step, then of its last token in a second
        step over the first's KV cache."""
        cfg, params = load(name)
        ids = np.asarray(reference(name)["cases"][CASE]["prompt_ids"], np.int32)
        T = len(ids)
        pages = -(-T // PAGE)
        table = [range(pages)]
        steps = [
            build_batch([T - 1], [T - 1], table, page_size=PAGE, num_pages=pages),
            build_batch([T], [1], table, page_size=PAGE, num_pages=pages),
        ]
        sharding = None
        if mesh is not None:
            cfg, params = parallel.shard_config(cfg, mesh.shape["tp"]), parallel.shard_params(params, cfg, mesh)
            sharding = parallel.kv_sharding(mesh)
        else:
            params = jax.tree.map(jnp.asarray, params)
        kv = init_kv_cache(cfg, pages, PAGE, jnp.dtype(kv_dtype), sharding=sharding)
        context = contextlib.nullcontext()
        if how.startswith("set_mesh"):
            context = jax.set_mesh(mesh)
        logits = []
        with context:
            for tokens, batch in zip((ids[:-1], ids[-1:]), steps, strict=True):
                kw = dict(backend=backend, mesh=mesh if (mesh is None or how.endswith("mesh=")) else None)
                out, kv = step(params, cfg, jnp.asarray(tokens), batch.positions, kv, batch.metadata, **kw)
                logits.append(out)
        pages0 = kv.k[0].values if hasattr(kv.k[0], "values") else kv.k[0]
        return {
            "logits": np.concatenate([np.asarray(a) for a in logits]).tolist(),
            "kv_spec": list(pages0.sharding.spec) if mesh is not None else None,
            "logits_spec": list(jax.typeof(logits[-1]).sharding.spec) if mesh is not None else None,
        }

    results: dict = {"one_device": {}, "runs": {}}
    for name, kv_dtype in sorted({(r[0], r[5]) for r in RUNS}):
        results["one_device"][f"{name}-{kv_dtype}"] = prefill_then_decode(name, None, "", "reference", kv_dtype)[
            "logits"
        ]
    for run in RUNS:
        name, tp, axis_type, how, backend, kv_dtype = run
        types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
        mesh = jax.make_mesh((tp,), ("tp",), axis_types=types, devices=jax.devices()[:tp])
        results["runs"]["-".join(map(str, run))] = prefill_then_decode(name, mesh, how, backend, kv_dtype)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _worker(sys.argv[1])
