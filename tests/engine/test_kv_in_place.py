"""The paged KV cache is updated in place: no compiled step variant copies a layer's page array. A copy costs the
whole cache's bytes every step (on CPU a 1 GiB cache made a SmolLM2 decode step 0.9 s instead of 0.04 s)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from support.checkpoints import FIXTURES

from netra_jax.engine.runner import ModelRunner
from netra_jax.loader import load_model

NUM_PAGES = 64
PAGE = 16


def _page_array_copies(hlo: str, cfg) -> list[str]:
    """The copy instructions of a compiled module whose result is a page array, or its flat [slots, ...] view."""
    dims = f"{cfg.num_kv_heads},{cfg.head_dim}"
    shapes = (f"[{NUM_PAGES},{PAGE},{dims}]", f"[{NUM_PAGES * PAGE},{dims}]")
    copy = re.compile(r"=\s*\w+(\[[\d,]*\])\S*\s+copy\(")
    return [line for line in hlo.splitlines() if (m := copy.search(line)) and m.group(1) in shapes]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt-oss"])  # gpt-oss: sliding layers, sinks, biases
@pytest.mark.parametrize("overlap", [False, True])
def test_no_step_variant_copies_the_pages(model: str, overlap: bool) -> None:
    cfg, params = load_model(FIXTURES / model, "float32")
    runner = ModelRunner(
        cfg,
        params,
        num_pages=NUM_PAGES,
        page_size=PAGE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        kv_dtype=jnp.float32,
        overlap=overlap,
    )
    shapes = {runner.shape_for(n) for n in (1, 2, 3, 8, 64)}  # a lone decode, decode batches, a prefill
    for shape in sorted(shapes, key=lambda s: s.num_tokens):
        hlo = runner.lower_step(shape).compile().as_text()
        copies = _page_array_copies(hlo, runner.cfg)
        assert not copies, f"{shape.num_tokens}-token step copies page arrays {len(copies)}x: {copies[0][:200]}"
