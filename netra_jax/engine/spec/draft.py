"""Draft-model proposer: a smaller model with the target's tokenizer proposes k tokens greedily. Its KV cache has
the target's page layout and shares the scheduler's block tables: it mirrors every target step, then decodes ahead."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from netra_jax.config import ModelConfig
from netra_jax.engine.request import Request
from netra_jax.engine.runner import ModelRunner, StepResult
from netra_jax.engine.scheduler import Scheduler
from netra_jax.engine_config import SpeculativeConfig
from netra_jax.models.transformer import forward
from netra_jax.ops.attention import AttentionMetadata, AttentionWork, num_items


def check_same_tokenizer(target, draft) -> None:
    """Raise ValueError unless the draft's tokenizer maps every id to the same token as the target's (its
    proposals are target token ids)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"the draft model's tokenizer has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
            "speculative decoding with a draft model needs the same tokenizer"
        )
    for i in range(target.vocab_size):
        if target.id_to_token(i) != draft.id_to_token(i):
            raise ValueError(
                f"the draft model's tokenizer differs from the target's at id {i} ({draft.id_to_token(i)!r} vs "
                f"{target.id_to_token(i)!r}): speculative decoding with a draft model needs the same tokenizer"
            )


def _decode_ahead(
    params, kv, tokens, positions, limits, block_tables, *, cfg, k, page_size, pad_slot, backend, matmul_backend
):
    """k greedy draft decode steps for S sequences in one call. tokens, positions: [S] int32 (each sequence's last
    known token and its position); limits: [S] int32 proposals wanted (0: a padding row); block_tables: [S, W].
    Step j feeds the previous step's argmax at position + j; steps at or past a row's limit write nothing.
    Returns (proposals [S, k] int32, kv)."""
    S = tokens.shape[0]
    rows = jnp.arange(S, dtype=jnp.int32)
    live = limits > 0  # [S]
    n_real = jnp.sum(live).astype(jnp.int32)  # live rows come first
    n_items = num_items(S, S)
    work = AttentionWork(
        tokens=jnp.where(live, rows, S),
        num_tokens=n_real,
        item_start=jnp.zeros(n_items, jnp.int32),
        item_len=jnp.zeros(n_items, jnp.int32),
        item_seq=jnp.zeros(n_items, jnp.int32),
        num_items=jnp.int32(0),
    )
    qsl = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), n_real)  # [S + 1] one token per live row

    def body(j, carry):
        kv, tok, out = carry
        pos = positions + j  # [S]
        writes = live & (j < limits)
        page = jnp.take_along_axis(block_tables, (pos // page_size)[:, None], 1, mode="clip")[:, 0]
        slot = jnp.where(writes, page * page_size + pos % page_size, pad_slot)
        md = AttentionMetadata(
            slot_mapping=slot,
            query_start_loc=qsl,
            seq_lens=jnp.where(live, pos + 1, 0),
            block_tables=block_tables,
            work=work,
        )
        logits, kv = forward(
            params, cfg, tok, jnp.where(live, pos, 0), kv, md, backend=backend, matmul_backend=matmul_backend
        )  # [S, vocab]
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)  # [S]
        return kv, nxt, out.at[:, j].set(nxt)

    kv, _, out = lax.fori_loop(0, k, body, (kv, tokens, jnp.zeros((S, k), jnp.int32)))
    return out, kv


class DraftProposer:
    """Proposals from a draft model. Every target step is also run by the draft (`observe`: same packed batch, its
    own KV array with the target's pages), so the draft's cache holds every token the target computed; `propose`
    reserves lookahead slots for each request (the scheduler allocates them in its block table) and decodes k
    tokens ahead from each request's last token."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        draft_cfg: ModelConfig,
        draft_params,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        if runner.mesh is not None:
            raise ValueError("a draft model is not supported together with tensor parallelism yet")
        self.k = config.num_speculative_tokens
        self.scheduler = scheduler
        self.target = runner
        self.draft = ModelRunner(
            draft_cfg,
            draft_params,
            num_pages=runner.num_pages,
            page_size=runner.page_size,
            max_num_seqs=runner.max_seqs_bucket,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kv_dtype=runner.kv.k[0].dtype,
            backend=runner.backend,
            matmul_backend=runner.matmul_backend,
            num_spec_tokens=runner.num_spec_tokens,
            max_spec_seqs=runner.max_spec_seqs,
        )
        self._decode = jax.jit(
            functools.partial(
                _decode_ahead,
                cfg=draft_cfg,
                k=self.k,
                page_size=runner.page_size,
                pad_slot=runner.pad_slot,
                backend=runner.backend,
                matmul_backend=runner.matmul_backend,
            ),
            donate_argnums=(1,),
        )

    def _row_buckets(self) -> list[int]:
        top = min(self.target.max_spec_seqs, self.target.max_seqs_bucket)
        return sorted({1 << (n - 1).bit_length() for n in range(1, top + 1)})

    def observe(self, run: StepResult) -> None:
        """Run the draft over the step the target just dispatched (same tokens, positions and slots)."""
        self.draft._dispatch(run.batch.host, run.batch.shape, None)

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        chosen = [
            i
            for i, (r, k) in enumerate(zip(requests, limits, strict=True))
            if k > 0 and self.scheduler.reserve_slots(r, r.num_tokens - 1 + k)
        ]
        if not chosen:
            return out
        S = next(b for b in self._row_buckets() if b >= len(chosen))
        W = self.target.max_pages
        tokens, positions, lim = (np.zeros(S, np.int32) for _ in range(3))
        tables = np.zeros((S, W), np.int32)
        for row, i in enumerate(chosen):
            r = requests[i]
            tokens[row], positions[row], lim[row] = r.all_token_ids[-1], r.num_tokens - 1, limits[i]
            tables[row, : len(r.block_ids)] = r.block_ids
        proposals, self.draft.kv = self._decode(self.draft.params, self.draft.kv, tokens, positions, lim, tables)
        proposals = np.asarray(proposals)
        for row, i in enumerate(chosen):
            out[i] = proposals[row, : limits[i]].tolist()
        return out

    def warmup(self) -> None:
        """Compile the draft's mirrored step variants and its decode-ahead for every row bucket."""
        for shape in self.draft.all_shapes():
            self.draft.warmup_shape(shape)
        W = self.target.max_pages
        for S in self._row_buckets():
            z = np.zeros(S, np.int32)
            proposals, self.draft.kv = self._decode(
                self.draft.params, self.draft.kv, z, z, z, np.zeros((S, W), np.int32)
            )
            jax.block_until_ready(proposals)
