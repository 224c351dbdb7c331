"""load_format="dummy": random parameters from config.json alone, with the real loader's pytree (structure, shapes,
dtypes) for every fixture family, generated on the device, sharded like the real loader under tensor parallelism,
and an engine that builds and generates from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, TINY_MODELS

from netra_jax import LLM, SamplingParams
from netra_jax.engine_args import add_engine_args, engine_config
from netra_jax.loader import CheckpointError, load_model
from netra_jax.loader.dummy import INIT_STD


def _layout(params) -> dict:
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), params)


MOE_MODELS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"]


@pytest.mark.parametrize("name", TINY_MODELS + MOE_MODELS)
def test_same_pytree_as_the_real_loader(name, dtype="bfloat16"):  # norms stay float32: both dtypes are checked
    _, real = load_model(FIXTURES / name, dtype, cache=False)
    cfg, fake = load_model(FIXTURES / name, dtype, load_format="dummy")
    assert jax.tree.structure(fake) == jax.tree.structure(real)
    assert _layout(fake) == _layout(real)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(fake))
    layer = fake["layers"][0]
    np.testing.assert_array_equal(np.asarray(layer["attn_norm"]), 1.0)
    wq = np.asarray(layer["wq"], np.float32)
    assert abs(wq.std() - INIT_STD) < 0.2 * INIT_STD and abs(wq.mean()) < 0.1 * INIT_STD
    assert not np.array_equal(wq, np.asarray(fake["layers"][-1]["wq"], np.float32))  # one draw per leaf
    if cfg.tie_word_embeddings:
        np.testing.assert_array_equal(np.asarray(fake["lm_head"]), np.asarray(fake["embed"]).T)


def test_llama_with_attention_bias_has_all_four_biases(tmp_path):
    """A Llama checkpoint with attention_bias: true carries q/k/v and o_proj biases (as transformers builds it); the
    dummy layout must have the same four the real loader reads."""
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "tiny-llama"
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((src / "config.json").read_text()) | {"attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight") and ".self_attn." in n]:
        tensors[name.replace(".weight", ".bias")] = np.ones(tensors[name].shape[0], tensors[name].dtype)
    save_file(tensors, tmp_path / "model.safetensors")
    _, real = load_model(tmp_path, "float32", cache=False)
    _, fake = load_model(tmp_path, "float32", load_format="dummy")
    assert {"bq", "bk", "bv", "bo"} <= set(real["layers"][0])
    assert _layout(fake) == _layout(real)


def test_dummy_needs_only_config_and_tokenizer(tmp_path):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny-llama" / f, tmp_path / f)  # no safetensors
    llm = LLM(str(tmp_path), load_format="dummy", warmup=False, max_model_len=64, num_kv_pages=16)
    outs = llm.generate(["hello world", {"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=5, ignore_eos=True))
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) == 5 and all(0 <= t < vocab for t in ids)
    with pytest.raises(CheckpointError):  # and the real format still wants the weights
        load_model(tmp_path, "float32", cache=False)


def test_bad_load_format_and_cli_flag():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        load_model(FIXTURES / "tiny-llama", load_format="random")
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["m", "--load-format", "dummy"])).load_format == "dummy"
    assert engine_config(p.parse_args(["m"])).load_format == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--load-format", "npz"])


_SHARDED = """
import jax
from netra_jax import parallel
from netra_jax.loader import load_model

assert len(jax.devices()) == 4
# tiny-llama: 2 KV heads over 4 devices, each stored twice as the real loader does; the MoE models split experts
for name, tp in (("tiny-llama", 4), ("tiny-qwen3-moe", 2), ("tiny-gpt-oss", 4)):
    path = f"{fixtures}/" + name
    mesh = parallel.make_mesh(tp)
    _, real = load_model(path, "float32", cache=False, mesh=mesh)
    _, fake = load_model(path, "float32", load_format="dummy", mesh=mesh)
    assert jax.tree.structure(real) == jax.tree.structure(fake), name
    for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(fake), strict=True):
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), (name, a.shape, b.shape)
        assert a.sharding.mesh.devices.tolist() == b.sharding.mesh.devices.tolist()
print("ok")
"""


def test_sharded_like_the_real_loader_under_tensor_parallelism():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    code = _SHARDED.format(fixtures=FIXTURES)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]
