"""Checkpoint loading: GGUF configs and weights against the HF fixtures and SmolLM2's transformers reference, the
orbax cache, and bad input (block layouts: test_gguf_quants.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES
from support.gguf_blocks import write_gguf
from support.hf_to_gguf import to_gguf

import netra_jax.loader as loader
from netra_jax.assets import default_model_path
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.loader import CheckpointError, gguf_loader, load_model, read_gguf_metadata
from netra_jax.loader import cache as param_cache
from netra_jax.loader.gguf_config import config_from_gguf_metadata
from netra_jax.loader.gguf_loader import GGUFFile
from netra_jax.models.transformer import forward, init_kv_cache
from netra_jax.ops.attention import AttentionMetadata

SMOL_REF = json.loads((FIXTURES / "smollm2/reference.json").read_text())
T_PAD = 40  # one compiled shape for every prompt (37, 26, 38 tokens) and for the decode steps
PAGE, N_PAGES = 16, 8


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("param_cache")


@pytest.fixture(scope="module")
def smol(smol_cache):
    path = default_model_path(quiet=True)
    cfg, params = load_model(path, "float32", cache=smol_cache)
    return path, cfg, params


def test_smollm2_gguf_config(smol):
    path, cfg, params = smol
    shape = (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads)
    assert shape == ("LlamaForCausalLM", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == (49152, 64, 1536, True)
    assert cfg.rope_full.theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.eos_token_ids == (2,)
    assert loader.load_config(path) == cfg
    assert params["layers"][0]["wq"].dtype == jnp.float32 and params["lm_head"].shape == (576, 49152)
    types = {t.qtype.name for t in GGUFFile(path).tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}  # what the shipped file actually contains


def test_smollm2_metadata_for_the_tokenizer(smol):
    meta = read_gguf_metadata(smol[0])
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert len(meta["tokenizer.ggml.merges"]) == 48900 and meta["tokenizer.ggml.merges"][0] == "Ġ t"
    assert len(meta["tokenizer.ggml.token_type"]) == 49152 and meta["tokenizer.ggml.model"] == "gpt2"
    assert "<|im_start|>" in meta["tokenizer.chat_template"] and meta["tokenizer.ggml.eos_token_id"] == 2


def _step(cfg, params, kv, ids: list[int], start: int, fwd):
    """Run `ids` (positions start..) as one padded batch of T_PAD tokens; logits of the last real token."""
    n = len(ids)
    tok = np.zeros(T_PAD, np.int32)
    tok[:n] = ids
    pos = np.zeros(T_PAD, np.int32)
    pos[:n] = np.arange(start, start + n)
    slots = np.full(T_PAD, N_PAGES * PAGE, np.int32)  # out of range: padding writes are dropped
    slots[:n] = np.arange(start, start + n)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        query_start_loc=jnp.array([0, n], jnp.int32),
        seq_lens=jnp.array([start + n], jnp.int32),
        block_tables=jnp.arange(N_PAGES, dtype=jnp.int32)[None],
    )
    logits, kv = fwd(params, cfg, jnp.asarray(tok), jnp.asarray(pos), kv, md, jnp.array([n - 1], jnp.int32))
    return np.asarray(logits[0]), kv


@pytest.fixture(scope="module")
def smol_fwd():
    return jax.jit(forward, static_argnums=(1,))


def test_smollm2_logits_and_greedy_match_transformers(smol, smol_fwd):
    _, cfg, params = smol
    max_err = 0.0
    for i, case in enumerate(SMOL_REF["cases"]):
        ids = case["prompt_ids"]
        kv = init_kv_cache(cfg, N_PAGES, PAGE)
        logits, kv = _step(cfg, params, kv, ids, 0, smol_fwd)
        ref = case["last_logits_top10"]
        assert np.argsort(-logits)[:10].tolist() == ref["ids"]
        err = float(np.abs(logits[ref["ids"]] - np.asarray(ref["values"])).max())
        assert err < 1e-3
        max_err = max(max_err, err)
        if i == 0:  # greedy decode through the KV cache, one token per step
            out = [int(np.argmax(logits))]
            for _ in range(7):
                logits, kv = _step(cfg, params, kv, [out[-1]], len(ids) + len(out) - 1, smol_fwd)
                out.append(int(np.argmax(logits)))
            assert out == case["greedy_ids"][:8]
    logging.getLogger(__name__).info("SmolLM2 max top-10 logit error %.2e", max_err)


def test_second_load_restores_from_cache_without_dequantizing(smol, smol_cache, monkeypatch):
    path, _, _ = smol  # kept in its blocks: nothing converted, nothing cached
    assert len([p for p in smol_cache.iterdir() if not p.name.startswith(".")]) == 0
    cfg, params = load_model(path, "float32", cache=smol_cache, keep_quantized=False)  # de-quantized, then cached
    assert len([p for p in smol_cache.iterdir() if not p.name.startswith(".")]) == 1

    def refuse(*a, **k):
        raise AssertionError("de-quantized although the cache holds this model")

    monkeypatch.setattr(gguf_loader, "dequantize", refuse)
    cfg2, params2 = load_model(path, "float32", cache=smol_cache, keep_quantized=False)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------- tiny fixtures converted the llama.cpp way
CFG_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
    "layer_types",
    "sliding_window",
    "rope_full",
    "rope_sliding",
    "attn_scale",
    "qk_norm",
    "norm_weight_offset",
    "sandwich_norms",
    "scale_embeddings",
    "rotary_dim",
    "eos_token_ids",
    "attention_sinks",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_layers",
    "norm_topk_prob",
    "expert_act",
    "swiglu_alpha",
    "swiglu_limit",
)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
def test_gguf_of_hf_fixture_gives_same_config_and_params(name, tmp_path):
    path = to_gguf(FIXTURES / name, tmp_path / f"{name}.gguf")
    cfg_g, p_g = load_model(path, "float32", cache=False)
    cfg_h, p_h = load_model(FIXTURES / name, "float32", cache=False)
    assert {f: getattr(cfg_g, f) for f in CFG_FIELDS} == {f: getattr(cfg_h, f) for f in CFG_FIELDS}
    assert jax.tree.structure(p_g) == jax.tree.structure(p_h)
    for a, b in zip(jax.tree.leaves(p_g), jax.tree.leaves(p_h), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
    if name == "tiny-gemma3":  # sliding-window layers, local rope base and norms reach the reference logits
        case = json.loads((FIXTURES / name / "reference.json").read_text())["cases"][0]
        ids = case["prompt_ids"]
        T, n_pages = len(ids), len(ids) // 16 + 1
        md = AttentionMetadata(
            slot_mapping=jnp.arange(T, dtype=jnp.int32),
            query_start_loc=jnp.array([0, T], jnp.int32),
            seq_lens=jnp.array([T], jnp.int32),
            block_tables=jnp.arange(n_pages, dtype=jnp.int32)[None],
        )
        kv = init_kv_cache(cfg_g, n_pages, 16)
        fwd = jax.jit(forward, static_argnums=(1,))
        logits, _ = fwd(p_g, cfg_g, jnp.array(ids, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, md)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(case["logits"]), atol=1e-4)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    theta, hd, factor, low, high, orig = 500000.0, 64, 32.0, 1.0, 4.0, 8192
    factors = []  # llama.cpp's converter: per-frequency divisor of the base inverse frequency
    for i in range(0, hd, 2):
        wavelen = 2 * np.pi * theta ** (i / hd)
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 128,
        "llama.attention.head_count": 2,
        "llama.block_count": 1,
        "llama.feed_forward_length": 256,
        "llama.rope.freq_base": theta,
    }
    cfg = config_from_gguf_metadata(meta, {"token_embd.weight": (100, 128)}, np.asarray(factors, np.float32))
    rc = cfg.rope_full
    assert (rc.rope_type, rc.factor, rc.low_freq_factor, rc.high_freq_factor) == ("llama3", 32.0, 1.0, 4.0)
    assert rc.original_max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and cfg.vocab_size == 100
    with pytest.raises(ConfigError, match="rope_freqs"):
        config_from_gguf_metadata(meta, {"token_embd.weight": (100, 128)}, np.linspace(1, 3, 32, dtype=np.float32))


# ----------------------------------------------------------------------------- cache behaviour, dtypes
def test_hf_cache_round_trip_bfloat16_and_damaged_entry(tmp_path, monkeypatch, caplog):
    src = tmp_path / "tiny-qwen3"
    shutil.copytree(FIXTURES / "tiny-qwen3", src)
    root = tmp_path / "cache"
    cfg, p1 = load_model(src, "bfloat16", cache=root)
    assert p1["layers"][0]["wq"].dtype == jnp.bfloat16 and p1["layers"][0]["q_norm"].dtype == jnp.float32
    (entry,) = [p for p in root.iterdir()]
    monkeypatch.setattr(loader, "HFCheckpoint", None)  # a conversion would now fail
    _, p2 = load_model(src, "bfloat16", cache=root)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    monkeypatch.undo()
    # the key follows dtype and the source files' identity
    assert load_model(src, "auto", cache=root)[1]["embed"].dtype == jnp.float32  # config says float32
    st = os.stat(src / "model.safetensors")
    os.utime(src / "model.safetensors", ns=(1, 1))
    load_model(src, "bfloat16", cache=root)
    assert len(list(root.iterdir())) == 3
    # a damaged entry is discarded with a warning and rebuilt; a writer's left-over temp dir is ignored
    os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    (entry / "manifest.json").write_text("{not json")
    (root / ".tmp-left-over").mkdir()
    with caplog.at_level(logging.WARNING):
        _ = load_model(src, "bfloat16", cache=root)
    assert "discarding unreadable parameter cache entry" in caplog.text
    assert json.loads((entry / "manifest.json").read_text())["format"] == param_cache.FORMAT_VERSION
    assert param_cache.save_params(root, entry.name, {"layers": []}) == entry  # an existing entry wins
    monkeypatch.setattr(param_cache, "MAX_ENTRIES", 2)  # least recently used entries are pruned
    os.utime(src / "model.safetensors", ns=(1, 1))
    load_model(src, "bfloat16", cache=root)  # touches the entry for mtime 1
    load_model(src, "auto", cache=root)  # a new entry (the source's mtime changed since the float32 load)
    assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == 2 and not entry.exists()


# ------------------------------------------------------------------------------------------ bad input
def test_missing_path_and_non_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope", cache=False)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="notes.txt"):
        load_model(tmp_path / "notes.txt", cache=False)
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(tmp_path / "fake.gguf", cache=False)
    with pytest.raises(ValueError, match="dtype"):
        load_model(FIXTURES / "tiny-llama", dtype="float16", cache=False)


def test_truncated_safetensors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "tiny-llama", d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d, cache=False)


def test_truncated_gguf(tmp_path):
    path = to_gguf(FIXTURES / "tiny-qwen2", tmp_path / "full.gguf")
    data = path.read_bytes()
    for cut, what in ((len(data) - 100, "truncated GGUF file"), (200, "truncated or corrupt GGUF header")):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=what) as e:
            load_model(bad, cache=False)
        assert str(bad) in str(e.value)


def test_gguf_tensor_table_with_wrong_type_or_shape_is_refused(tmp_path):
    """A tensor whose type or shape was corrupted would read its neighbour's bytes (the file's size still checks
    out): refused at load naming the tensor."""
    path = to_gguf(FIXTURES / "tiny-qwen2", tmp_path / "full.gguf")
    data = path.read_bytes()
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)  # tensor info: name, n_dims u32, dims u64 x n_dims, type u32, offset u64
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == gguf.GGMLQuantizationType.F32
    for where, value in (  # the type F32 -> F64, the rows doubled
        (type_at, int(gguf.GGMLQuantizationType.F64).to_bytes(4, "little")),
        (at + 12, (2 * int.from_bytes(data[at + 12 : at + 20], "little")).to_bytes(8, "little")),
    ):
        bad = bytearray(data)
        bad[where : where + len(value)] = value
        (tmp_path / "bad.gguf").write_bytes(bad)
        with pytest.raises(CheckpointError, match="corrupt GGUF tensor table: tensor 'blk.0.attn_q.weight'"):
            load_model(tmp_path / "bad.gguf", cache=False)


def test_unsupported_architectures(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "falcon", {"falcon.block_count": 1}, {"a": np.ones((2, 32), np.float32)})
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'falcon'.*llama, qwen2, qwen3, gemma2"):
        load_model(path, cache=False)
    d = tmp_path / "hf"
    shutil.copytree(FIXTURES / "tiny-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(d, cache=False)
    assert isinstance(ModelConfig.from_hf_dir(FIXTURES / "tiny-llama"), ModelConfig)


def test_auto_dtype_without_a_config_dtype_follows_the_stored_weights(tmp_path):
    """A config.json naming no dtype (published gpt-oss) loads in the floating dtype most of its bytes are stored in,
    as transformers' "auto" does, not float32 (twice the memory)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "tiny-llama"
    d = tmp_path / "bf16-no-dtype"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(src / "model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, d / "model.safetensors")
    config = json.loads((d / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (d / "config.json").write_text(json.dumps(config))
    _, params = load_model(d, cache=False)
    assert params["layers"][0]["wq"].dtype == jnp.bfloat16 and params["embed"].dtype == jnp.bfloat16
    assert params["layers"][0]["attn_norm"].dtype == jnp.float32  # norms stay float32
    _, params = load_model(src, cache=False)  # the fixture's own float32 weights and config
    assert params["layers"][0]["wq"].dtype == jnp.float32
