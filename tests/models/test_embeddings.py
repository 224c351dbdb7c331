"""Embedding models (task "embed") against transformers: tests/fixtures/tiny-qwen3-embed is Qwen3-Embedding's
layout (bare Qwen3Model weight names, no lm_head, sentence-transformers last-token pooling + Normalize) and its
reference.json holds transformers' hidden states and sentence-transformers' embeddings (make_tiny_qwen3_embed.py).
Covers LLM.embed, last / mean / first-token pooling, batching and padding, dimensions, truncation and bad input,
the checkpoint's pooling config, and no compilation after warm-up."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import DATA, FIXTURES

from netra_jax.api import LLM
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.engine.embedder import Embedder
from netra_jax.engine_config import PoolerConfig
from netra_jax.loader import load_model
from netra_jax.models.weight_map import WeightError
from netra_jax.pooling import (
    PoolingError,
    PoolingParams,
    PoolingSpec,
    finish_embeddings,
    pooler_config_from,
    pooling_spec,
    sentence_transformers_pooler,
)
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving.embeddings import EmbeddingBatcher
from netra_jax.serving.metrics import CompileCounter

EMBED = DATA / "tiny-qwen3-embed"
REF = json.loads((EMBED / "reference.json").read_text())
CASES = REF["cases"]
MAX_LEN = 128  # the longest case has 100 tokens
TOL = 1e-4


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def prompt(case: dict):
    return case["text"] if case["text"] is not None else {"prompt_token_ids": case["ids"]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EMBED, task="embed", max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN, max_num_seqs=8, warmup=True)


# ---------------------------------------------------------------------------------------------- against references
def test_embed_matches_transformers_and_sentence_transformers(llm):
    """Last-token pooling + L2 norm (from the checkpoint's modules.json) of every case, batched together, equals the
    normalized last hidden state transformers computes, and sentence-transformers' own padded-batch encoding."""
    assert (llm.engine.pooling.pooling_type, llm.engine.pooling.normalize, llm.engine.pooling.source) == (
        "LAST",
        True,
        "modules.json",
    )
    outs = llm.embed([prompt(c) for c in CASES])
    got = np.array([o.outputs.embedding for o in outs])  # [cases, hidden]
    for case, out in zip(CASES, outs, strict=True):
        assert out.prompt_token_ids == case["ids"]  # the tokenizer appends <|endoftext|> to text, as the reference
    want = np.array([unit(np.array(c["hidden"])[-1]) for c in CASES])
    err = np.abs(got - want).max()
    assert err < TOL, err
    np.testing.assert_allclose(got, np.array([c["last"] for c in CASES]), atol=TOL)
    st = np.array(REF["sentence_transformers"]["last"])
    np.testing.assert_allclose(got[: len(st)], st, atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_pooling_types_on_device(llm, pooling):
    """The device pooling of each type over one ragged batch equals the same pooling of transformers' hidden
    states (mean: also sentence-transformers' mean Pooling + Normalize)."""
    embedder = Embedder(llm.engine.runner, pooling, MAX_LEN)
    pooled = embedder.embed([c["ids"] for c in CASES])  # [cases, hidden], unnormalized
    pick = {"MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0], "LAST": lambda h: h[-1]}[pooling]
    want = np.array([pick(np.array(c["hidden"], np.float64)) for c in CASES])
    np.testing.assert_allclose(pooled, want, atol=TOL)
    normed = np.array([unit(v) for v in pooled])
    if pooling == "MEAN":
        np.testing.assert_allclose(normed, np.array([c["mean"] for c in CASES]), atol=TOL)
        st = np.array(REF["sentence_transformers"]["mean"])
        np.testing.assert_allclose(normed[: len(st)], st, atol=TOL)


def test_mean_pooling_from_pooler_config():
    """LLM(pooler_config=...) overrides the checkpoint's LAST with MEAN (vLLM's --pooler-config); unnormalized on
    request."""
    llm = LLM(
        EMBED,
        task="embed",
        max_model_len=MAX_LEN,
        max_num_batched_tokens=MAX_LEN,
        max_num_seqs=8,
        pooler_config={"pooling_type": "MEAN"},
        warmup=False,
    )
    assert (llm.engine.pooling.pooling_type, llm.engine.pooling.source) == ("MEAN", "pooler_config")
    cases = CASES[:3]
    outs = llm.embed([prompt(c) for c in cases])
    np.testing.assert_allclose([o.outputs.embedding for o in outs], [c["mean"] for c in cases], atol=TOL)
    raw = llm.embed([prompt(c) for c in cases], PoolingParams(normalize=False))
    want = [np.array(c["hidden"]).mean(0) for c in cases]
    np.testing.assert_allclose([o.outputs.embedding for o in raw], want, atol=TOL)


# ---------------------------------------------------------------------------------------------- batching
def test_batching_and_padding_do_not_change_a_result(llm):
    """Each case alone (its own bucket), all at once, reversed, and split over several steps (2 sequences per step)
    give the same vectors, up to float32 rounding (matmul shapes differ)."""
    ids = [c["ids"] for c in CASES]
    engine = llm.engine
    alone = np.concatenate([engine.embed([p]) for p in ids])
    together = engine.embed(ids)
    backwards = engine.embed(ids[::-1])[::-1]
    small = Embedder(engine.runner, "LAST", MAX_LEN)
    small.max_seqs = 2
    assert len(small.batches(ids)) == 4
    split = small.embed(ids)
    for other in (together, backwards, split):
        np.testing.assert_allclose(other, alone, atol=1e-5)  # float32 sums in another order


def test_batches_respect_the_token_budget(llm):
    embedder = llm.engine.embedder
    assert embedder.buckets == (16, 32, 64, 128)
    groups = embedder.batches([[1] * 100, [1] * 20, [1] * 8, [1] * 100])
    assert [list(g) for g in groups] == [[0, 1, 2], [3]]
    assert all(sum((100, 20, 8, 100)[i] for i in g) <= 128 for g in groups)


def test_no_compilation_after_warmup(llm):
    """Warm-up compiled every bucket: batches of any size and length compile nothing more."""
    ids = [c["ids"] for c in CASES]
    llm.engine.embed(ids)
    CompileCounter.install()
    before = CompileCounter.count
    for batch in (ids[:1], ids[3:4], ids, ids[1:5], [[5] * 128], [[5] * 17, [6] * 3]):
        llm.engine.embed(batch)
    llm.embed(["hello", "a longer sentence to embed"], PoolingParams(dimensions=8))
    assert CompileCounter.count == before, list(CompileCounter.recent)


def test_concurrent_requests_share_one_engine_call(llm):
    """Requests arriving while the batcher is busy go into one engine call, and get the vectors they would get
    alone."""
    ids = [c["ids"] for c in CASES[:4]]
    alone = [llm.engine.embed([p]) for p in ids]
    ae = AsyncEngine(llm.engine)
    try:
        batcher = EmbeddingBatcher(ae)

        async def run():
            return await asyncio.gather(*(batcher.embed([p]) for p in ids))

        got = asyncio.run(run())
        assert batcher.num_calls == 1
        for g, a in zip(got, alone, strict=True):
            np.testing.assert_allclose(g, a, atol=1e-5)
    finally:
        ae.shutdown()


# ---------------------------------------------------------------------------------------------- dimensions, params
def test_dimensions_truncate_then_normalize(llm):
    case = CASES[2]
    last = np.array(case["hidden"])[-1]
    (out,) = llm.embed([prompt(case)], PoolingParams(dimensions=16))
    np.testing.assert_allclose(out.outputs.embedding, unit(last[:16]), atol=TOL)
    (raw,) = llm.embed([prompt(case)], PoolingParams(dimensions=16, use_activation=False))
    np.testing.assert_allclose(raw.outputs.embedding, last[:16], atol=TOL)
    assert raw.outputs.hidden_size == 16


def test_dimensions_rules():
    """vLLM's: a model that is not Matryoshka refuses any dimensions; a listed set refuses the others; plus ours:
    not above the hidden size."""
    plain = PoolingSpec("LAST", True, 64)
    with pytest.raises(PoolingError, match="does not support matryoshka") as e:
        PoolingParams(dimensions=8).verify(plain, "m")
    assert e.value.param == "dimensions"
    listed = PoolingSpec("LAST", True, 64, matryoshka=True, matryoshka_dimensions=(16, 32))
    PoolingParams(dimensions=32).verify(listed, "m")
    with pytest.raises(PoolingError, match=r"only supports \[16, 32\]"):
        PoolingParams(dimensions=8).verify(listed, "m")
    free = PoolingSpec("LAST", True, 64, matryoshka=True)
    for bad, match in ((0, "greater than 0"), (-3, "greater than 0"), (65, "larger than the model's embedding size")):
        with pytest.raises(PoolingError, match=match):
            PoolingParams(dimensions=bad).verify(free, "m")
    PoolingParams(dimensions=64).verify(free, "m")
    with pytest.raises(PoolingError, match="disagree"):
        PoolingParams(use_activation=True, normalize=False).verify(free, "m")


def test_matryoshka_capability_read_from_config(tmp_path):
    assert pooling_spec(EMBED, 64).matryoshka  # the fixture's config.json: is_matryoshka
    model = _copy_fixture(tmp_path / "listed", config={"matryoshka_dimensions": [16, 32]})
    assert pooling_spec(model, 64).matryoshka_dimensions == (16, 32)
    model = _copy_fixture(tmp_path / "plain", config={"is_matryoshka": False})
    assert not pooling_spec(model, 64).matryoshka
    llm = LLM(model, task="embed", max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN, warmup=False)
    with pytest.raises(PoolingError, match="does not support matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=8))


def test_finish_embeddings_shapes():
    pooled = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], np.float32)  # [2, 3]
    spec = PoolingSpec("LAST", True, 3, matryoshka=True)
    np.testing.assert_allclose(finish_embeddings(pooled, PoolingParams(), spec)[0], [3 / 13, 4 / 13, 12 / 13])
    np.testing.assert_allclose(finish_embeddings(pooled, PoolingParams(dimensions=2), spec)[0], [0.6, 0.8])
    assert np.all(finish_embeddings(pooled, PoolingParams(), spec)[1] == 0)  # a zero vector stays zero, no NaN


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input(llm):
    too_long = list(range(1, MAX_LEN + 2))  # 129 tokens
    for bad, match in (
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 512]}, "outside the vocabulary"),
        ({"prompt_token_ids": too_long}, "maximum context length is 128 tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.embed([prompt(CASES[0]), bad])
    with pytest.raises(PoolingError, match="greater than max_model_len"):
        llm.embed({"prompt_token_ids": too_long}, truncate_prompt_tokens=200)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = list(range(1, 201))  # 200 tokens > the context
    last_100 = llm.engine.embed([long[-100:]])[0]
    for k in (100, -1):
        (out,) = llm.embed({"prompt_token_ids": long}, PoolingParams(truncate_prompt_tokens=k))
        assert out.prompt_token_ids == long[-(100 if k == 100 else MAX_LEN) :]
    (out,) = llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=100)
    np.testing.assert_allclose(out.outputs.embedding, unit(last_100), atol=1e-6)


def test_int8_weights():
    """Weight-only int8 (the lm_head, absent here, is skipped): the embeddings stay close to the float ones."""
    llm = LLM(EMBED, task="embed", max_model_len=MAX_LEN, max_num_batched_tokens=32, quantization="int8", warmup=False)
    assert "lm_head" not in llm.engine.runner.params
    cases = [c for c in CASES if len(c["ids"]) <= 32]
    outs = llm.embed([prompt(c) for c in cases])
    cosines = [np.dot(o.outputs.embedding, c["last"]) for o, c in zip(outs, cases, strict=True)]
    assert min(cosines) > 0.99, cosines
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.engine.embedder.embed([[1] * (MAX_LEN + 1)])


def test_task_mismatch(llm):
    with pytest.raises(ValueError, match="task 'generate'"):
        llm.generate("hello", SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="no lm_head"):
        llm.logits([1, 2, 3])
    generator = LLM(FIXTURES / "tiny-qwen3", max_model_len=MAX_LEN, num_kv_pages=16, warmup=False)
    with pytest.raises(ValueError, match="task 'embed'"):
        generator.embed("hello")


# ---------------------------------------------------------------------------------------------- loading, config
def test_checkpoint_without_lm_head_and_model_prefix(tmp_path):
    """The fixture's weights are named without `model.` and have no lm_head: they load for embedding (to the same
    parameters as tiny-qwen3's), and for generation fail with a hint at --task embed."""
    cfg, params = load_model(EMBED, "float32", cache=False, task="embed")
    assert "lm_head" not in params
    _, source = load_model(FIXTURES / "tiny-qwen3", "float32", cache=False)
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(source["embed"]))
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wq"]), np.asarray(source["layers"][1]["wq"]))
    with pytest.raises(WeightError, match="--task embed"):
        load_model(EMBED, "float32", cache=False)
    cached_root = tmp_path / "cache"
    _, first = load_model(EMBED, "float32", cache=cached_root, task="embed")
    _, again = load_model(EMBED, "float32", cache=cached_root, task="embed")  # from the parameter cache
    assert "lm_head" not in again
    np.testing.assert_array_equal(np.asarray(again["final_norm"]), np.asarray(first["final_norm"]))


def test_base_model_architectures():
    d = json.loads((EMBED / "config.json").read_text())
    for arch, family in (("Qwen3Model", "qwen3"), ("Qwen2Model", "qwen2"), ("MistralModel", "mistral")):
        assert ModelConfig.from_hf_dict({**d, "architectures": [arch]}).family == family


def _copy_fixture(dst: Path, config: dict | None = None, pooling: dict | None = None, modules=None) -> Path:
    shutil.copytree(EMBED, dst)
    if config is not None:
        d = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**d, **config}))
    if pooling is not None:
        (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if modules is not None:
        (dst / "modules.json").write_text(json.dumps(modules))
    return dst


def test_sentence_transformers_pooling_config(tmp_path):
    assert sentence_transformers_pooler(EMBED) == PoolerConfig("LAST", True)
    assert sentence_transformers_pooler(FIXTURES / "tiny-qwen3") is None  # no modules.json
    new_style = _copy_fixture(tmp_path / "a", pooling={"embedding_dimension": 64, "pooling_mode": "mean"})
    assert sentence_transformers_pooler(new_style) == PoolerConfig("MEAN", True)
    modules = json.loads((EMBED / "modules.json").read_text())[:2]  # no Normalize module
    cls = _copy_fixture(tmp_path / "b", pooling={"pooling_mode_cls_token": True}, modules=modules)
    assert sentence_transformers_pooler(cls) == PoolerConfig("CLS", False)
    assert pooling_spec(cls, 64) == PoolingSpec("CLS", False, 64, matryoshka=True, source="modules.json")
    assert pooling_spec(cls, 64, PoolerConfig(normalize=True)).normalize  # an override wins field by field
    maxed = _copy_fixture(tmp_path / "c", pooling={"pooling_mode_max_tokens": True})
    with pytest.raises(ConfigError, match="max_tokens is not supported"):
        sentence_transformers_pooler(maxed)
    assert pooling_spec(None, 64) == PoolingSpec("LAST", True, 64)  # vLLM's embed default


def test_pooler_config_forms():
    assert pooler_config_from('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False)
    assert pooler_config_from({"seq_pooling_type": "CLS", "use_activation": True}) == PoolerConfig("CLS", True)
    for bad, match in (
        ("{", "not valid JSON"),
        ('{"pooling": "MEAN"}', "unknown key"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
        ('{"normalize": "yes"}', "true or false"),
    ):
        with pytest.raises(ConfigError, match=match):
            pooler_config_from(bad)
