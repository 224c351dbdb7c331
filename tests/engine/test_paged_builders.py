"""netra_jax.paged on the tiny fixtures: its docstring's example (a padded prefill of two prompts, then a decode step
over the same cache) run as written, and prompts prefilled in chunks and decoded over shuffled pages, checked against
transformers' logits (reference.json) and against the engine's forward (`LLM.logits`); bad batches are refused."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, reference

from netra_jax import LLM, paged
from netra_jax.loader import load_model
from netra_jax.models.transformer import forward

ATOL = 1e-4  # float32 against transformers, as the fixtures' README says


def _example_code() -> str:
    """The module docstring's example, with its checkpoint path pointed at the fixture."""
    code = textwrap.dedent(paged.__doc__.split("::\n", 1)[1].split("\n`forward(")[0])
    line = 'model_dir = "tiny-llama"'
    assert line in code
    return code.replace(line, f"model_dir = {str(FIXTURES / 'tiny-llama')!r}")


@pytest.fixture(scope="module")
def llama_llm() -> LLM:
    return LLM(FIXTURES / "tiny-llama", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=16)


def test_docstring_example_matches_transformers_and_the_engine(llama_llm):
    ns: dict = {}
    exec(compile(_example_code(), "paged-example", "exec"), ns)
    cases = reference("tiny-llama")["cases"]
    (p0, p1), (n0, n1) = ns["prompts"], (len(ns["prompts"][0]), len(ns["prompts"][1]))
    assert p0 == cases[0]["prompt_ids"][:n0] and p1 == cases[1]["prompt_ids"][:n1]  # prefixes of the references
    want0, want1 = np.asarray(cases[0]["logits"]), np.asarray(cases[1]["logits"])
    prefill, decode = np.asarray(ns["prefill_logits"]), np.asarray(ns["decode_logits"])
    assert prefill.shape == (16, 512) and decode.shape == (2, 512)
    np.testing.assert_allclose(np.asarray(ns["first"]), want0[:n0], atol=ATOL)
    np.testing.assert_allclose(prefill[n0 : n0 + n1], want1[:n1], atol=ATOL)
    np.testing.assert_allclose(decode, np.stack([want0[n0], want1[n1]]), atol=ATOL)  # the token after each prompt
    # the engine's forward of the same tokens (its own scratch cache and metadata)
    np.testing.assert_allclose(prefill[:n0], llama_llm.logits(p0), atol=1e-5)
    engine = np.stack([llama_llm.logits(cases[0]["prompt_ids"][: n0 + 1])[-1], llama_llm.logits(p1 + [10])[-1]])
    np.testing.assert_allclose(decode, engine, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_chunked_prefill_and_decode_over_shuffled_pages(name):
    """Every reference prompt of the fixture at once: the first part prefilled in two chunks padded to 64 tokens
    (the second chunk attends to the first in the cache), the last 4 tokens decoded one step at a time through
    `last_token_indices`, each sequence on pages drawn at random; each row against transformers' logits. Gemma 3's
    sliding window (16 tokens) is crossed by its longer prompts."""
    cfg, params = load_model(FIXTURES / name, "float32")
    cases = reference(name)["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    page_size, num_pages = 4, 64
    kv = paged.init_kv_cache(cfg, num_pages, page_size, jnp.float32)
    rng = np.random.default_rng(1)
    order = rng.permutation(num_pages)
    tables, used = [], 0
    for p in prompts:
        n = -(-len(p) // page_size)
        tables.append(order[used : used + n].tolist())
        used += n
    got = [[] for _ in prompts]
    prefill_end = [len(p) - 4 for p in prompts]
    half = [e // 2 for e in prefill_end]
    for lo, hi in ((None, half), (half, prefill_end)):
        starts = [0] * len(prompts) if lo is None else lo
        new = [p[s:e] for p, s, e in zip(prompts, starts, hi, strict=True)]
        batch = paged.build_batch(
            hi, [len(x) for x in new], tables, page_size=page_size, num_pages=num_pages, num_tokens=64, num_seqs=4
        )
        assert batch.num_tokens == sum(len(x) for x in new) <= 64
        logits, kv = forward(params, cfg, paged.flat_tokens(new, 64), batch.positions, kv, batch.metadata)
        t = 0
        for i, x in enumerate(new):
            got[i].append(np.asarray(logits[t : t + len(x)]))
            t += len(x)
    for step in range(4):
        ends = [e + step + 1 for e in prefill_end]
        batch = paged.build_batch(ends, [1] * len(prompts), tables, page_size=page_size, num_pages=num_pages)
        tokens = paged.flat_tokens([[p[e - 1]] for p, e in zip(prompts, ends, strict=True)])
        logits, kv = forward(params, cfg, tokens, batch.positions, kv, batch.metadata, batch.last_token_indices)
        for i in range(len(prompts)):
            got[i].append(np.asarray(logits[i : i + 1]))
    for i, c in enumerate(cases):
        np.testing.assert_allclose(np.concatenate(got[i]), np.asarray(c["logits"]), atol=ATOL)


def test_padding_writes_nothing():
    """Padding tokens go to the padding slot, past the cache: the pages after a padded batch equal those after the
    same batch unpadded."""
    cfg, params = load_model(FIXTURES / "tiny-llama", "float32")
    prompt = reference("tiny-llama")["cases"][1]["prompt_ids"]
    pages = []
    for pad in (None, 32):
        kv = paged.init_kv_cache(cfg, 4, 8, jnp.float32)
        batch = paged.build_batch([10], [10], [[2, 0]], page_size=8, num_pages=4, num_tokens=pad, num_seqs=pad and 3)
        assert int(batch.metadata.slot_mapping[-1]) == (paged.padding_slot(4, 8) if pad else 1)
        _, kv = forward(params, cfg, paged.flat_tokens([prompt], pad), batch.positions, kv, batch.metadata)
        pages.append(np.asarray(kv.k[0]))
    np.testing.assert_array_equal(pages[0], pages[1])
    assert np.abs(pages[0][[1, 3]]).max() == 0  # the pages no sequence owns stay empty


@pytest.mark.parametrize(
    "args, kw, match",
    [
        (([5], [5, 1], [[0]]), {}, "one seq_len, query_len and block table per sequence"),
        (([5], [0], [[0, 1]]), {}, r"query_len 0 must be in \[1, seq_len 5\]"),
        (([5], [6], [[0, 1]]), {}, r"query_len 6 must be in \[1, seq_len 5\]"),
        (([9], [9], [[0, 1]]), {}, "2 pages of 4 cannot hold its 9 tokens"),
        (([5], [5], [[0, 8]]), {}, r"names a page outside \[0, 8\)"),
        (([5], [5], [[0, 1]]), {"num_tokens": 4}, "5 tokens, 1 sequences"),
        (([5, 3], [5, 3], [[0, 1], [2]]), {"num_seqs": 1}, "do not fit"),
    ],
)
def test_bad_batches_are_refused(args, kw, match):
    with pytest.raises(ValueError, match=match):
        paged.build_batch(*args, page_size=4, num_pages=8, **kw)
