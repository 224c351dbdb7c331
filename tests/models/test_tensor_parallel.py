"""Tensor parallelism: specs and slice reads in this process; logits, greedy generations, placement, donation and the
compiled collectives on 4 fake CPU devices in a subprocess (jax here was already initialised with one device)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference
from support.workers import run_device_worker

from netra_jax import parallel
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.loader.hf import HFCheckpoint
from netra_jax.models.weight_map import hf_to_params

# model -> tensor-parallel sizes run on the fake devices (tp=4 on tiny-llama and tiny-qwen2 replicates KV heads;
# the mixture-of-experts models split every expert on its intermediate axis)
MATRIX = {
    "tiny-llama": (1, 2, 4),
    "tiny-qwen3": (1, 2),
    "tiny-qwen2": (1, 4),
    "tiny-gemma3": (1, 2),
    "tiny-qwen3-moe": (1, 2),
    "tiny-mixtral": (1, 2),
    "tiny-gpt-oss": (1, 2),
}
GREEDY_TOKENS = 24
HOOKED_RECORDS = ["layers.0.attn_heads", "layers.1.resid_post"]
CASE = 0  # the 29-token prompt: two KV pages, and longer than tiny-gemma3's 16-token sliding window


# ------------------------------------------------------------------------------------------ in-process checks
def test_split_rules():
    llama = ModelConfig.from_hf_dir(FIXTURES / "tiny-llama")  # 4 heads, 2 KV heads, intermediate 160
    qwen2 = ModelConfig.from_hf_dir(FIXTURES / "tiny-qwen2")  # 4 heads, 1 KV head
    assert parallel.shard_config(llama, 2).num_kv_heads == 2
    assert parallel.shard_config(llama, 4).num_kv_heads == 4  # each KV head stored twice
    assert parallel.shard_config(qwen2, 4).num_kv_heads == 4
    with pytest.raises(ConfigError, match="num_heads=4 is not divisible"):
        parallel.check_tp(llama, 3)
    with pytest.raises(ConfigError, match="num_kv_heads=2"):
        parallel.check_tp(llama.replace(num_heads=6, num_kv_heads=2, intermediate_size=96), 3)
    # per-device KV bytes of one page: one of tp heads, never below one head per device
    full = 2 * llama.num_layers * 16 * llama.kv_size * 4
    assert parallel.kv_bytes_per_page_per_device(llama, 16, np.float32, 1) == full
    assert parallel.kv_bytes_per_page_per_device(llama, 16, np.float32, 2) == full // 2
    assert parallel.kv_bytes_per_page_per_device(llama, 16, np.float32, 4) == full // 2


def test_cli_flag_reaches_engine_config():
    import argparse

    from netra_jax.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["m", "--tensor-parallel-size", "4"])).tensor_parallel_size == 4
    assert engine_config(p.parse_args(["m"])).tensor_parallel_size == 1


@pytest.mark.parametrize("name,tp", [("tiny-llama", 4), ("tiny-qwen2", 2), ("tiny-gemma3", 2)])
def test_slice_reader_matches_full_conversion(name, tp):
    """Every device's slice, read straight from the memory map, equals that slice of the full conversion (with KV
    heads expanded as `shard_params` does), and reads exactly the slice's bytes of each source tensor."""
    cfg = ModelConfig.from_hf_dir(FIXTURES / name)
    ck = HFCheckpoint(FIXTURES / name)
    full = hf_to_params(cfg, ck.get, ck.has, np.float32)
    r = parallel.kv_replicas(cfg, tp)
    if r > 1:
        full = {**full, "layers": [parallel._expand_kv(lp, cfg, r) for lp in full["layers"]]}
    reader, leaves = parallel.sharded_leaves(ck.get, ck.has, cfg, np.float32, tp)
    specs = parallel.param_specs(leaves, cfg, tp)
    flat_l, tree = _flatten(leaves)
    flat_f, flat_s = tree.flatten_up_to(full), tree.flatten_up_to(specs)
    n_sharded = 0
    for leaf, want, spec in zip(flat_l, flat_f, flat_s, strict=True):
        assert leaf.shape == want.shape
        axis = next((i for i, s in enumerate(spec) if s == parallel.TP), None)
        n_sharded += axis is not None
        for d in range(tp if axis is not None else 1):
            idx = [slice(None)] * want.ndim
            if axis is not None:
                n = want.shape[axis] // tp
                idx[axis] = slice(d * n, (d + 1) * n)
            reader.reads.log.clear()
            got = leaf.read(parallel._norm_index(tuple(idx), want.shape))
            np.testing.assert_array_equal(got, want[tuple(idx)])
            assert sum(b for _, _, b in reader.reads.log) == got.nbytes  # f32 source: bytes read == bytes of the slice
    assert n_sharded == 2 + 6 * cfg.num_layers + (3 if name == "tiny-qwen2" else 0) * cfg.num_layers


def _flatten(tree):
    import jax

    return jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, parallel.Leaf))


# ------------------------------------------------------------------------------------------ 4-device subprocess
@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return run_device_worker(__file__, tmp_path_factory.mktemp("tp") / "results.json")


def test_logits_match_single_device_and_reference(tp_results):
    for name, tps in MATRIX.items():
        want = np.asarray(reference(name)["cases"][CASE]["logits"], np.float32)
        base = np.asarray(tp_results[name]["1"]["logits"], np.float32)
        for tp in tps:
            got = np.asarray(tp_results[name][str(tp)]["logits"], np.float32)
            assert got.shape == want.shape
            assert np.abs(got - base).max() < 1e-5, (name, tp)
            assert np.abs(got - want).max() < 1e-4, (name, tp)


def test_greedy_generation_matches(tp_results):
    for name, tps in MATRIX.items():
        want = reference(name)["cases"][CASE]["greedy_ids"][:GREEDY_TOKENS]
        for tp in tps:
            assert tp_results[name][str(tp)]["greedy"] == want, (name, tp)


def test_hooks_match_single_device(tp_results):
    """Hooks under tensor parallelism: the head mask reaches the head-split attention output and the recorded
    activations come back whole, as on one device."""
    base = tp_results["tiny-llama"]["1"]["hooked"]
    plain = np.asarray(tp_results["tiny-llama"]["1"]["logits"], np.float32)
    assert np.abs(np.asarray(base["logits"]) - plain).max() > 1e-2  # the masked head matters
    for tp in MATRIX["tiny-llama"][1:]:
        got = tp_results["tiny-llama"][str(tp)]["hooked"]
        np.testing.assert_allclose(got["logits"], base["logits"], atol=1e-5)
        assert got["greedy"] == base["greedy"]
        for name in HOOKED_RECORDS:
            np.testing.assert_allclose(got["activations"][name], base["activations"][name], atol=1e-5)
            np.testing.assert_allclose(got["generated"][name], base["generated"][name], atol=1e-5)


def test_parameters_and_kv_are_sharded(tp_results):
    for name, tps in MATRIX.items():
        cfg = ModelConfig.from_hf_dir(FIXTURES / name)
        for tp in tps:
            if tp == 1:
                continue
            r = tp_results[name][str(tp)]
            kvh = parallel.shard_config(cfg, tp).num_kv_heads
            assert r["specs"]["wq"] == [None, "tp"] and r["specs"]["wo"] == ["tp", None]
            assert r["specs"]["lm_head"] == [None, "tp"] and r["specs"]["embed"] == ["tp", None]
            assert r["specs"]["attn_norm"] == [] and r["specs"]["kv"] == [None, None, "tp", None]
            assert r["shards"]["wq"] == [[cfg.hidden_size, cfg.q_size // tp]] * tp
            assert r["shards"]["wk"] == [[cfg.hidden_size, kvh * cfg.head_dim // tp]] * tp
            if cfg.num_experts:  # every expert split on its intermediate axis, the router replicated
                E, inter = cfg.num_experts, cfg.moe_intermediate_size
                assert r["specs"]["experts_gate_up"] == [None, None, None, "tp"]
                assert r["specs"]["experts_down"] == [None, "tp", None] and r["specs"]["router"] == []
                assert r["shards"]["experts_gate_up"] == [[E, cfg.hidden_size, 2, inter // tp]] * tp
                assert r["shards"]["experts_down"] == [[E, inter // tp, cfg.hidden_size]] * tp
            else:
                assert r["specs"]["w_gate_up"] == [None, None, "tp"] and r["specs"]["w_down"] == ["tp", None]
                assert r["shards"]["w_gate_up"] == [[cfg.hidden_size, 2, cfg.intermediate_size // tp]] * tp
            if cfg.attention_sinks:  # split with the query heads
                assert r["shards"]["sinks"] == [[cfg.num_heads // tp]] * tp
            assert r["shards"]["lm_head"] == [[cfg.hidden_size, cfg.vocab_size // tp]] * tp
            assert r["shards"]["kv"] == [[r["num_pages"], 16, kvh // tp, cfg.head_dim]] * tp
            assert r["kv_donated"], (name, tp)


def test_compiled_step_collectives(tp_results):
    """Row-split wo and w_down (or the experts' down projections: one psum of [T, hidden] per MoE layer) each end in
    one all-reduce, the vocab-split embedding lookup in one more, and the vocab-split logits in one all-gather;
    nothing else moves between devices (no weight or KV gathers)."""
    for name, tps in MATRIX.items():
        cfg = ModelConfig.from_hf_dir(FIXTURES / name)
        for tp in tps:
            if tp == 1:
                continue
            c = tp_results[name][str(tp)]["collectives"]
            assert len(c["all-reduce"]) == 2 * cfg.num_layers + 1, (name, tp, c)
            assert all(shape[-1] == cfg.hidden_size for shape in c["all-reduce"])
            assert c["all-gather"] == [[1, cfg.vocab_size]], (name, tp, c)  # the logits row of the decode step
            assert c["other"] == [], (name, tp, c)


def test_sharded_load_reads_only_slices(tp_results):
    r = tp_results["tiny-llama"]["4"]["reads"]
    size = {n: b for n, b in r["tensor_bytes"].items()}
    wq = "model.layers.0.self_attn.q_proj.weight"
    assert r["per_read"][wq] == [size[wq] // 4] * 4  # four devices, a quarter each
    wk = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads on 4 devices: each device reads one head's rows
    assert r["per_read"][wk] == [size[wk] // 2] * 4
    norm = "model.layers.0.input_layernorm.weight"
    assert all(b == size[norm] for b in r["per_read"][norm])  # replicated: each device reads it whole
    assert r["callback_indices"]["wq"] == [[[0, 64], [16 * d, 16 * (d + 1)]] for d in range(4)]


def test_pallas_attention_runs_per_device(tp_results):
    got = np.asarray(tp_results["triton_interpret"], np.float32)
    assert np.abs(got - np.asarray(tp_results["tiny-llama"]["1"]["logits"], np.float32)).max() < 1e-5


def test_int8_kv_cache_splits_values_and_scales_by_heads(tp_results):
    r = tp_results["int8_kv"]
    assert r["2"]["greedy"] == r["1"]["greedy"]
    assert r["2"]["specs"] == [[None, None, "tp", None], [None, None, "tp"]]
    assert r["2"]["scale_shards"] == [[16, 16, 1]] * 2  # tiny-llama's 2 KV heads, one per device


def test_gguf_loads_then_shards(tp_results):
    g = tp_results["gguf"]
    assert g["converted"] and g["cached"]
    assert g["converted_wk_shards"] == g["cached_wk_shards"] == [[64, 16]] * 4  # 1 KV head of 16 -> one per device


# ------------------------------------------------------------------------------------------ the worker
def _collectives(hlo: str) -> dict:
    import re

    out = {"all-reduce": [], "all-gather": [], "other": []}
    for line in hlo.splitlines():
        m = re.search(
            r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
            r"(-start)?\(",
            line,
        )
        if m:
            shape = [int(x) for x in m.group(2).split(",") if x]
            out[m.group(3) if m.group(3) in out else "other"].append(shape)
    return out


def _worker(out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    from netra_jax import LLM, SamplingParams
    from netra_jax.engine.factory import enable_compilation_cache

    assert len(jax.devices()) == 4
    enable_compilation_cache(os.environ.get("NETRA_JAX_TEST_XLA_CACHE") or None)  # as conftest does
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    results: dict = {}
    for name, tps in MATRIX.items():
        case = reference(name)["cases"][CASE]
        results[name] = {}
        for tp in tps:
            llm = LLM(
                FIXTURES / name,
                dtype="float32",
                tensor_parallel_size=tp,
                max_num_seqs=4,
                max_num_batched_tokens=32,
                num_kv_pages=16,
                warmup=False,
            )
            r: dict = {"logits": llm.logits(case["prompt_ids"]).tolist()}
            out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, greedy, use_tqdm=False)[0]
            r["greedy"] = out.outputs[0].token_ids
            if name == "tiny-llama":  # hooks: a head mask on the head-split attention output, recordings
                r["hooked"] = _hooked(llm, case["prompt_ids"], greedy)
            runner = llm.engine.runner
            if tp > 1:
                lp, p = runner.params["layers"][0], runner.params
                mlp = ("experts_gate_up", "experts_down", "router") if "router" in lp else ("w_gate_up", "w_down")
                named = {k: lp[k] for k in ("wq", "wk", "wo", "attn_norm", *mlp, "sinks") if k in lp}
                named.update(embed=p["embed"], lm_head=p["lm_head"], kv=runner.kv.k[0])
                r["specs"] = {k: list(a.sharding.spec) for k, a in named.items()}
                r["shards"] = {k: [list(s.data.shape) for s in a.addressable_shards] for k, a in named.items()}
                r["num_pages"] = runner.num_pages
                old = runner.kv.k[0]
                shape = runner.shape_for(1)  # the decode step generate compiled
                runner.warmup_shape(shape)
                r["kv_donated"] = old.is_deleted() and runner.kv.k[0].sharding == old.sharding
                buf = jnp.zeros(shape.packed_len(), jnp.int32)
                hlo = (
                    runner._jit.lower(
                        runner.params, runner.kv, buf, cfg=runner.cfg, shape=shape, backend=runner.backend
                    )
                    .compile()
                    .as_text()
                )
                r["collectives"] = _collectives(hlo)
            if name == "tiny-llama" and tp == 4:
                r["reads"] = _read_log(name, llm.engine.model_config, runner.mesh)
            results[name][str(tp)] = r
            del llm
    # the Pallas kernel (interpreted) inside the per-device attention: XLA cannot partition it, shard_map must
    llm = LLM(
        FIXTURES / "tiny-llama",
        dtype="float32",
        tensor_parallel_size=2,
        attention_backend="triton_interpret",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_pages=16,
        warmup=False,
    )
    results["triton_interpret"] = llm.logits(reference("tiny-llama")["cases"][CASE]["prompt_ids"]).tolist()
    # an int8 KV cache: its values and scales split by heads alike, the same greedy tokens as on one device
    results["int8_kv"] = {}
    for tp in (1, 2):
        llm = LLM(
            FIXTURES / "tiny-llama",
            dtype="float32",
            kv_cache_dtype="int8",
            tensor_parallel_size=tp,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_kv_pages=16,
            warmup=False,
        )
        prompt = {"prompt_token_ids": reference("tiny-llama")["cases"][CASE]["prompt_ids"]}
        out = llm.generate(prompt, greedy, use_tqdm=False)
        k0 = llm.engine.runner.kv.k[0]
        results["int8_kv"][str(tp)] = {
            "greedy": out[0].outputs[0].token_ids,
            "specs": [list(k0.values.sharding.spec), list(k0.scales.sharding.spec)] if tp > 1 else None,
            "scale_shards": [list(s.data.shape) for s in k0.scales.addressable_shards],
        }
    results["gguf"] = _gguf_check(Path(out_path).parent)
    Path(out_path).write_text(json.dumps(results))


def _hooked(llm, prompt_ids: list[int], greedy) -> dict:
    """A head-masked, recording forward and generation, for comparison across tensor-parallel sizes."""
    from netra_jax import Hooks

    mask = np.ones(llm.model_config.num_heads, np.float32)
    mask[1] = 0.0
    hooks = Hooks(head_mask={1: mask}, record=HOOKED_RECORDS)
    run = llm.run_with_hooks(prompt_ids, hooks)
    out = llm.generate({"prompt_token_ids": prompt_ids}, greedy, hooks=hooks, use_tqdm=False)[0]
    return {
        "logits": run.logits.tolist(),
        "activations": {k: v.tolist() for k, v in run.activations.items()},
        "greedy": out.outputs[0].token_ids,
        "generated": {k: v.tolist() for k, v in out.activations.items()},
    }


def _refuse(*a, **k):
    raise AssertionError("de-quantized although the parameter cache holds the model")


def _gguf_check(tmp: Path) -> dict:
    """tiny-qwen2 (1 KV head) as GGUF on 4 devices: de-quantized whole, then placed; again from the param cache."""
    import jax
    from support.hf_to_gguf import to_gguf

    from netra_jax.loader import gguf_loader, load_model

    path = to_gguf(FIXTURES / "tiny-qwen2", tmp / "tiny-qwen2.gguf")
    mesh = parallel.make_mesh(4)
    cfg, full = load_model(path, "float32", cache=False)
    want = parallel.shard_params(full, cfg, mesh)
    out = {}
    for label in ("converted", "cached"):
        _, got = load_model(path, "float32", cache=tmp / "params", mesh=mesh)
        same = jax.tree.map(lambda a, b: a.sharding == b.sharding and np.array_equal(a, b), got, want)  # same tree
        out[label] = all(jax.tree.leaves(same))
        out[f"{label}_wk_shards"] = [list(s.data.shape) for s in got["layers"][0]["wk"].addressable_shards]
        gguf_loader.dequantize = _refuse  # the cached load must not de-quantize again
    return out


def _read_log(name: str, cfg, mesh) -> dict:
    ck = HFCheckpoint(FIXTURES / name)
    reader, leaves = parallel.sharded_leaves(ck.get, ck.has, cfg, np.float32, parallel.tp_size(mesh))
    indices: dict = {}
    wq = leaves["layers"][0]["wq"]
    read = wq.read

    def logged(idx):  # log the shard index jax asks each wq callback for
        indices.setdefault("wq", []).append([[s.start, s.stop] for s in idx])
        return read(idx)

    wq.read = logged
    parallel.place_leaves(leaves, cfg, mesh)
    per_read: dict = {}
    for n, _, b in reader.reads.log:
        per_read.setdefault(n, []).append(b)
    indices["wq"].sort(key=lambda x: x[1][0])
    return {"per_read": per_read, "tensor_bytes": {n: ck.get(n).nbytes for n in ck.keys()}, "callback_indices": indices}


if __name__ == "__main__":
    _worker(sys.argv[1])
