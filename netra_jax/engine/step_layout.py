"""The packed step array: one int32 array per step carrying every piece of batch metadata (one host->device copy).
Its layout is declared once here (named fields -> offsets); packing on the host and unpacking in the jit read it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from netra_jax.engine.scheduler import PROMPT_LOGPROB_ROWS, ScheduledRequest, SchedulerOutput, prompt_logprob_rows
from netra_jax.ops.attention import AttentionMetadata, AttentionWork, build_work, num_items
from netra_jax.paged import token_slots

__all__ = [
    "PROMPT_LOGPROB_ROWS",
    "FIELD_ALIGN",
    "BatchShape",
    "PackedBatch",
    "StepLayout",
    "layout_buffer",
    "pack_batch",
    "unpack",
]


@dataclass(frozen=True)
class BatchShape:
    """Static shape of one compiled step variant."""

    num_tokens: int  # T
    num_seqs: int  # S
    max_pages: int  # W (block-table width)
    prompt_rows: int = 0  # P: prompt positions whose logprobs this variant computes (0: none)
    logit_rows: int = 0  # R: logit rows sampled; 0 = one per sequence (S). Speculative variants sample more

    @property
    def num_rows(self) -> int:
        """Logit rows the step returns and the sampler draws from: S, or the speculative variant's R."""
        return self.logit_rows or self.num_seqs

    @property
    def num_items(self) -> int:
        return num_items(self.num_tokens, self.num_seqs)

    @property
    def layout(self) -> StepLayout:
        return StepLayout.of(self)

    def packed_len(self) -> int:
        return self.layout.size


# Every field starts on a 256-byte boundary. XLA passes a static slice of the packed array to a custom call as an
# address inside it (dynamic-slice fusion), and Mosaic GPU kernels refuse any buffer not 256-byte aligned ("Input
# buffer 3 is not 256-byte aligned": the block tables at element 8 of the array, seen on an H200).
FIELD_ALIGN = 64  # int32 elements: 256 bytes


@dataclass(frozen=True)
class StepLayout:
    """Named fields of the packed step array, in order, each with its length; offsets follow from the order, each
    rounded up to FIELD_ALIGN elements (the gaps hold zeros)."""

    fields: tuple[tuple[str, int], ...]

    @staticmethod
    @functools.cache
    def of(shape: BatchShape) -> StepLayout:
        T, S, W, N, P = shape.num_tokens, shape.num_seqs, shape.max_pages, shape.num_items, shape.prompt_rows
        R = shape.num_rows
        return StepLayout(
            (
                ("tokens", T),  # token ids (a placeholder's slot holds 0 and is filled on device)
                ("positions", T),
                ("slots", T),  # flat KV slot per token; padding tokens get an out-of-range slot
                ("prev_rows", T),  # row of the previous step's sampled ids that is this token, -1: token known
                ("query_start_loc", S + 1),
                ("seq_lens", S),
                ("logits_idx", R),  # sampled rows: each sequence's last token (and its proposed tokens' inputs)
                ("block_tables", S * W),
                ("work_tokens", T),  # attention work lists (see ops.attention.build_work)
                ("work_num_tokens", 1),
                ("item_start", N),
                ("item_len", N),
                ("item_seq", N),
                ("num_items", 1),
                ("prompt_idx", P),  # token whose logits give a prompt logprob row
                ("prompt_target", P),  # the prompt token that follows it (its logprob and rank are wanted)
            )
        )

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        out, o = {}, 0
        for name, n in self.fields:
            o = -(-o // FIELD_ALIGN) * FIELD_ALIGN
            out[name] = (o, o + n)
            o += n
        return out

    @property
    def size(self) -> int:
        return max(hi for _, hi in self.offsets.values())

    def view(self, buf, name: str):
        """The field `name` of a packed array (numpy: a writable view; jax: a slice)."""
        lo, hi = self.offsets[name]
        return buf[lo:hi]


class StepInputs(NamedTuple):
    """The packed array read back inside the jitted step."""

    tokens: object  # [T] int32
    positions: object  # [T] int32
    prev_rows: object  # [T] int32
    md: AttentionMetadata
    logits_idx: object  # [R] int32
    prompt_idx: object  # [P] int32
    prompt_target: object  # [P] int32


def unpack(packed, shape: BatchShape) -> StepInputs:
    lay = shape.layout
    f = functools.partial(lay.view, packed)
    md = AttentionMetadata(
        slot_mapping=f("slots"),
        query_start_loc=f("query_start_loc"),
        seq_lens=f("seq_lens"),
        block_tables=f("block_tables").reshape(shape.num_seqs, shape.max_pages),
        work=AttentionWork(
            tokens=f("work_tokens"),
            num_tokens=f("work_num_tokens")[0],
            item_start=f("item_start"),
            item_len=f("item_len"),
            item_seq=f("item_seq"),
            num_items=f("num_items")[0],
        ),
    )
    return StepInputs(
        f("tokens"), f("positions"), f("prev_rows"), md, f("logits_idx"), f("prompt_idx"), f("prompt_target")
    )


@dataclass
class PackedBatch:
    shape: BatchShape
    host: np.ndarray  # [shape.packed_len()] int32, laid out by shape.layout
    num_seqs: int  # real sequences
    num_tokens: int  # real tokens
    prompt_rows: list[tuple[int, int]]  # per prompt-logprob row: (index in scheduled, position in the prompt)
    row_start: list[int]  # per scheduled request: its first sampled row (then one more per proposed token)


def empty_batch(shape: BatchShape, pad_slot: int) -> np.ndarray:
    """An all-padding packed array: no token is written, no sequence attends, every placeholder index is off."""
    return layout_buffer(shape, [], pad_slot)[0]


def layout_buffer(
    shape: BatchShape, q_lens: list[int], pad_slot: int, per_token: list[bool] | None = None
) -> tuple[np.ndarray, StepLayout]:
    """A packed array for sequences of `q_lens` new tokens with everything but their tokens filled in: padding
    slots, no placeholders, the attention work lists (`per_token`: see build_work). The caller writes tokens,
    positions, slots and the tables."""
    lay = shape.layout
    buf = np.zeros(lay.size, np.int32)
    lay.view(buf, "slots")[:] = pad_slot
    lay.view(buf, "prev_rows")[:] = -1
    tokens, nt, start, length, seq, ni = build_work(q_lens, shape.num_tokens, shape.num_seqs, per_token)
    for name, value in (
        ("work_tokens", tokens),
        ("work_num_tokens", nt),
        ("item_start", start),
        ("item_len", length),
        ("item_seq", seq),
        ("num_items", ni),
    ):
        lay.view(buf, name)[:] = value
    return buf, lay


def prompt_logprob_positions(sr: ScheduledRequest) -> range:
    """Prompt positions of a scheduled chunk whose logprob rows are wanted."""
    return prompt_logprob_rows(sr.request, sr.start, sr.num_new_tokens)


def pack_batch(
    out: SchedulerOutput,
    shape: BatchShape,
    page_size: int,
    pad_slot: int,
    prev_rows: dict[str, int] | None = None,
) -> PackedBatch:
    """Lay the scheduled requests out as one flat token batch in a single int32 array (one host->device copy).
    A chunk's last token may still be a placeholder (sampled by the previous step, not yet on the host): its slot
    names that step's row in `prev_rows` (request id -> row) and the step gathers the token on device.
    A chunk ending in k proposed tokens samples k + 1 rows (its last known token's and each proposal's), and its
    tokens take the per-token attention path, so each verified token is computed exactly as a lone decode."""
    spec = [bool(sr.spec_token_ids) for sr in out.scheduled]
    buf, lay = layout_buffer(shape, [sr.num_new_tokens for sr in out.scheduled], pad_slot, spec if any(spec) else None)
    tok, pos, slot, prev = (lay.view(buf, k) for k in ("tokens", "positions", "slots", "prev_rows"))
    qsl, seq_lens, lidx = (lay.view(buf, k) for k in ("query_start_loc", "seq_lens", "logits_idx"))
    bt = lay.view(buf, "block_tables").reshape(shape.num_seqs, shape.max_pages)
    p_idx, p_target = lay.view(buf, "prompt_idx"), lay.view(buf, "prompt_target")
    prompt_rows: list[tuple[int, int]] = []
    row_start: list[int] = []
    t = r = 0
    for s, sr in enumerate(out.scheduled):
        n, start = sr.num_new_tokens, sr.start
        known = sr.token_ids
        tok[t : t + len(known)] = known
        if len(known) < n:  # the placeholder: the token the previous step sampled for this request
            if prev_rows is None or n - len(known) != 1:
                raise ValueError(f"request {sr.request_id!r} is scheduled on unknown tokens")
            prev[t + n - 1] = prev_rows[sr.request_id]
        pos[t : t + n] = np.arange(start, start + n, dtype=np.int32)
        slot[t : t + n] = token_slots(sr.block_ids, start, start + n, page_size)
        bt[s, : len(sr.block_ids)] = sr.block_ids
        seq_lens[s] = start + n
        prompt = sr.request.prompt_token_ids
        for q in prompt_logprob_positions(sr):
            j = len(prompt_rows)
            if j >= shape.prompt_rows:
                raise ValueError(f"more prompt logprob rows than the step's {shape.prompt_rows}")
            p_idx[j], p_target[j] = t + q - start, prompt[q + 1]
            prompt_rows.append((s, q))
        t += n
        qsl[s + 1] = t
        k = len(sr.spec_token_ids) + 1  # sampled rows of this request: the inputs of its last k tokens
        if r + k > shape.num_rows:
            raise ValueError(f"more sampled rows than the step's {shape.num_rows}")
        row_start.append(r)
        lidx[r : r + k] = np.arange(t - k, t, dtype=np.int32)
        r += k
    ns = len(out.scheduled)
    qsl[ns + 1 :] = t
    return PackedBatch(shape=shape, host=buf, num_seqs=ns, num_tokens=t, prompt_rows=prompt_rows, row_start=row_start)
