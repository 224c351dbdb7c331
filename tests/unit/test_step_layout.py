"""The packed step array's layout (netra_jax/engine/step_layout.py): every field on a 256-byte boundary, so that a
slice of it that XLA hands a GPU kernel as an address inside the array is one the kernel accepts, and the fields
read back in the jit as they were written on the host."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from netra_jax.engine.step_layout import FIELD_ALIGN, BatchShape, layout_buffer, unpack

SHAPES = [
    BatchShape(num_tokens=1, num_seqs=1, max_pages=128),
    BatchShape(num_tokens=7, num_seqs=3, max_pages=5, prompt_rows=3),
    BatchShape(num_tokens=2048, num_seqs=256, max_pages=129, prompt_rows=64, logit_rows=300),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s.num_tokens}_S{s.num_seqs}_W{s.max_pages}")
def test_every_field_starts_on_a_256_byte_boundary_in_order(shape):
    lay = shape.layout
    assert FIELD_ALIGN * np.dtype(np.int32).itemsize == 256
    prev_end = 0
    for name, n in lay.fields:
        lo, hi = lay.offsets[name]
        assert lo % FIELD_ALIGN == 0 and hi - lo == n, name
        assert prev_end <= lo < prev_end + FIELD_ALIGN, name  # no overlap, no more padding than the boundary needs
        prev_end = hi
    assert lay.size == prev_end == shape.packed_len()


def test_fields_read_back_in_the_jit_as_written():
    shape = SHAPES[1]
    buf, lay = layout_buffer(shape, [4, 2, 1], pad_slot=999)
    tables = np.arange(shape.num_seqs * shape.max_pages, dtype=np.int32).reshape(shape.num_seqs, -1) + 10
    lay.view(buf, "block_tables").reshape(shape.num_seqs, shape.max_pages)[:] = tables
    lay.view(buf, "tokens")[:] = np.arange(shape.num_tokens) + 100
    lay.view(buf, "query_start_loc")[:] = [0, 4, 6, 7]
    got = unpack(jnp.asarray(buf), shape)
    np.testing.assert_array_equal(got.md.block_tables, tables)
    np.testing.assert_array_equal(got.tokens, np.arange(shape.num_tokens) + 100)
    np.testing.assert_array_equal(got.md.query_start_loc, [0, 4, 6, 7])
    np.testing.assert_array_equal(got.md.slot_mapping, np.full(shape.num_tokens, 999))
    np.testing.assert_array_equal(got.prev_rows, np.full(shape.num_tokens, -1))
