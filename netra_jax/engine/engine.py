"""The engine loop: validate and tokenize requests, schedule a step, run it on the device, sample, then append
tokens, detokenize, apply stop strings and emit vLLM-shaped outputs. Single-threaded; AsyncEngine wraps it."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from netra_jax.config import EngineConfig, ModelConfig
from netra_jax.detokenizer import IncrementalDetokenizer
from netra_jax.engine.block_pool import BlockPool
from netra_jax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from netra_jax.engine.request import Request, RequestStatus
from netra_jax.engine.runner import ModelRunner, num_pages_for
from netra_jax.engine.scheduler import Scheduler, SchedulerOutput
from netra_jax.ops import sampling
from netra_jax.sampling_params import SamplingParams
from netra_jax.structured_output import GrammarMatcher, StructuredOutputs
from netra_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict[str, Any]


@dataclass
class _Seq:
    """Host-side state of one sample (one scheduler Request) of a user request."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    text: str = ""  # detokenized text, stop string cut
    emitted: int = 0  # characters of `text` already returned as deltas
    tokens_emitted: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finished: bool = False
    grammar: GrammarMatcher | None = None  # structured output: masks each step, ends the request when complete


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq] = field(default_factory=list)
    arrival: float = 0.0
    prompt_logprobs: list | None = None


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread (see AsyncEngine)."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, params, tokenizer: Tokenizer):
        self.config = config
        self.model_config = model_cfg
        self.tokenizer = tokenizer
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings
        )
        cache, sched = config.cache, config.scheduler
        kv_dtype = params["embed"].dtype if config.kv_dtype == "auto" else np.dtype(config.kv_dtype)
        page = cache.page_size
        useful = 2 * sched.max_num_seqs * -(-self.max_model_len // page)
        num_pages = num_pages_for(model_cfg, cache, kv_dtype, page, useful, config.tensor_parallel_size)
        self.pool = BlockPool(num_pages, page, enable_prefix_caching=cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.pool, self.max_model_len)
        self.runner = ModelRunner(
            model_cfg, params, num_pages=num_pages, page_size=page, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=self.max_model_len,
            kv_dtype=kv_dtype, backend=config.resolved_backend(), tensor_parallel_size=config.tensor_parallel_size,
        )  # fmt: skip
        self._groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Seq]] = {}  # scheduler request id -> (group, seq)
        self._rng = random.Random(config.seed)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, model_cfg.eos_token_ids)
        self.num_requests = 0
        self.ready = False

    # ------------------------------------------------------------------ construction helpers
    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_total * self.pool.block_size

    def warmup(self) -> float:
        """Compile every token bucket of the model step and the sampler variants; returns seconds spent."""
        t0 = time.perf_counter()
        shapes = self.runner.all_shapes()
        for shape in shapes:
            self.runner.warmup_shape(shape)
        sampling.warm_up(sorted({s.num_seqs for s in shapes}), self.vocab_size)
        self.ready = True
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, self._check_ids(prompt)

    def _check_ids(self, ids) -> list[int]:
        try:
            ids = [int(i) for i in ids] if not isinstance(ids, (str, bytes)) else None
        except (TypeError, ValueError):
            ids = None
        if ids is None:
            raise ValueError("prompt_token_ids must be a list of integers")
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request (n samples become n scheduler requests sharing the prompt's blocks).
        Raises ValueError for bad input before anything reaches the device; the engine state is unchanged."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if (cap := self.config.scheduler.max_waiting) is not None and params.n > cap:  # else "queue full" forever
            raise ValueError(f"n={params.n} samples can never fit the waiting queue (max_waiting {cap})")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} (at least one token "
                "must be left to generate)"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        grammar = self.structured.matcher(params.structured_outputs) if params.structured_outputs else None
        arrival = arrival_time or time.time()
        group = _Group(request_id, text, ids, params, arrival=arrival)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = self._prompt_logprobs(ids, params.prompt_logprobs)
        base_seed = params.seed
        requests = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = (base_seed + i) if base_seed is not None else self._rng.getrandbits(31)
            sp = params.clone(seed=seed)
            req = Request(rid, ids, sp, eos_token_ids=self.tokenizer.eos_token_ids or self.model_config.eos_token_ids,
                          arrival_time=arrival)  # fmt: skip
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
            seq = _Seq(req, i, detok, logprobs=[] if params.logprobs is not None else None,
                       cumulative_logprob=0.0 if params.logprobs is not None else None)  # fmt: skip
            seq.grammar = grammar.copy() if grammar is not None and i else grammar
            group.seqs.append(seq)
            requests.append(req)
        added = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req)
        except Exception:
            for req in added:
                self.scheduler.abort_request(req.request_id)
            raise
        self._groups[request_id] = group
        for seq in group.seqs:
            self._seq_of[seq.request.request_id] = (group, seq)
        self.num_requests += 1

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: None for the first token, then each prompt token's logprob plus the top k."""
        logits = self.runner.prompt_logits(ids)[:-1]  # [len - 1, vocab]: row i predicts token i + 1
        m = logits.max(-1, keepdims=True)
        lp = logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))
        out: list[dict[int, Logprob] | None] = [None]
        dec = self.tokenizer.decode
        for i, tok in enumerate(ids[1:]):
            row = lp[i]
            rank = int((row > row[tok]).sum()) + 1
            entry = {tok: Logprob(float(row[tok]), rank, dec([tok], skip_special_tokens=False))}
            if k:
                for r, t in enumerate(np.argsort(-row, kind="stable")[:k]):
                    entry.setdefault(int(t), Logprob(float(row[t]), r + 1, dec([int(t)], skip_special_tokens=False)))
            out.append(entry)
        return out

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples) and free its KV blocks now. Returns False if it is unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            self.scheduler.abort_request(seq.request.request_id)
            self._seq_of.pop(seq.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------ the step
    def _row(self, seq: _Seq) -> sampling.RowSampling:
        req = seq.request
        sp = req.sampling_params
        bias = dict(sp.logit_bias) if sp.logit_bias else None
        if req.num_output_tokens < sp.min_tokens:  # EOS and stop tokens may not end it yet
            bias = bias or {}
            for t in (*req.eos_token_ids, *sp.stop_token_ids):
                bias[t] = float("-inf")
        row = sampling.RowSampling(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, logit_bias=bias, seed=sp.seed, step=req.num_output_tokens,
            num_logprobs=sp.logprobs,
        )  # fmt: skip
        if row.uses_penalties:
            row.prompt_ids, row.output_ids = req.prompt_token_ids, req.output_token_ids
        if seq.grammar is not None:
            row.allowed = seq.grammar.mask()
        return row

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that changed (new tokens or finished)."""
        sched = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        if not sched.is_empty:
            self._run(sched, outputs)
        return list(outputs.values())

    def _run(self, sched: SchedulerOutput, outputs: dict[str, RequestOutput]) -> None:
        logits, pb = self.runner.run(sched)  # dispatched; the device works while the host builds sampling rows
        rows = [self._row(self._seq_of[s.request_id][1]) if s.sample else None for s in sched.scheduled]
        batch = sampling.build_sampling_batch(rows, pb.shape.num_seqs, self.vocab_size)
        so = sampling.sample(logits, jax.device_put(batch.arrays), key=batch.key)
        ids = np.asarray(so.token_ids)
        lps = None if so.logprobs is None else (np.asarray(so.logprobs), np.asarray(so.top_ids),
                                                 np.asarray(so.top_logprobs))  # fmt: skip
        sampled = {s.request_id: [int(ids[i])] for i, s in enumerate(sched.scheduled) if s.sample}
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, sampled)}
        changed: dict[str, _Group] = {}
        for i, s in enumerate(sched.scheduled):  # first every sample's token, then one output per request
            if not s.sample or s.request_id not in self._seq_of:
                continue
            group, seq = self._seq_of[s.request_id]
            if s.request.num_output_tokens == seq.tokens_emitted:  # skipped (finished or aborted meanwhile)
                continue
            self._append_token(group, seq, int(ids[i]), i, lps, batch)
            if s.request_id in finished:
                seq.finished = True
            changed[group.request_id] = group
        for rid, group in changed.items():
            outputs[rid] = self._output(group)

    def _append_token(self, group: _Group, seq: _Seq, tok: int, row: int, lps, batch) -> None:
        req = seq.request
        sp = req.sampling_params
        if seq.grammar is not None:
            self._advance_grammar(seq, tok)
        seq.tokens_emitted = req.num_output_tokens
        stopped_by_token = req.status is RequestStatus.FINISHED_STOPPED and not sp.include_stop_str_in_output
        hide = stopped_by_token and (tok in req.eos_token_ids or tok in sp.stop_token_ids)
        new_text = "" if hide and sp.skip_special_tokens else seq.detok.push([tok])
        if req.is_finished:
            new_text += seq.detok.flush()
        if lps is not None and seq.logprobs is not None:
            lp, top_ids, top_lp = lps
            entry = {tok: Logprob(float(lp[row]), None, self.tokenizer.decode([tok], skip_special_tokens=False))}
            k = int(batch.num_logprobs[row])
            for r in range(k):
                tid = int(top_ids[row, r])
                if tid == tok:
                    entry[tok].rank = r + 1
                entry.setdefault(
                    tid, Logprob(float(top_lp[row, r]), r + 1, self.tokenizer.decode([tid], skip_special_tokens=False))
                )
            seq.logprobs.append(entry)
            seq.cumulative_logprob += float(lp[row])
        seq.text += new_text
        if sp.stop and not req.is_finished:
            self._check_stop_strings(seq, len(new_text))
        elif sp.stop and req.is_finished:
            self._check_stop_strings(seq, len(new_text), already_finished=True)

    def _advance_grammar(self, seq: _Seq, tok: int) -> None:
        """Feed the sampled token to the sample's grammar; finish the request with "stop" once the grammar is
        complete, or with "error" if the token broke it (a mask that allowed nothing)."""
        req = seq.request
        ok = seq.grammar.accept(tok)
        if req.is_finished:
            return
        if not ok:
            err = (seq.grammar.error or "")[:300]
            log.warning("request %s: token %d rejected by its grammar: %s", req.request_id, tok, err)
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        elif seq.grammar.done:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        else:
            return
        seq.finished = True

    def _check_stop_strings(self, seq: _Seq, n_new: int, already_finished: bool = False) -> None:
        sp = seq.request.sampling_params
        if n_new == 0:
            return
        longest = max(len(s) for s in sp.stop)
        start = max(0, len(seq.text) - n_new - longest + 1)
        best = None
        for s in sp.stop:
            j = seq.text.find(s, start)
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return
        j, s = best
        seq.text = seq.text[: j + len(s)] if sp.include_stop_str_in_output else seq.text[:j]
        req = seq.request
        if already_finished:
            req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED_STOPPED, "stop", s
        else:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, s)
        seq.finished = True

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for seq in group.seqs:
            req = seq.request
            sp = req.sampling_params
            done = req.is_finished
            # while running, hold back a possible partial stop string
            hold = 0 if done or not sp.stop else max(len(s) for s in sp.stop) - 1
            visible = max(seq.emitted, len(seq.text) - hold)
            delta = seq.text[seq.emitted : visible]
            seq.emitted = visible
            outs.append(
                CompletionOutput(
                    index=seq.index, text=seq.text[:visible], token_ids=list(req.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                    finish_reason=req.finish_reason if done else None, stop_reason=req.stop_reason if done else None,
                    delta_text=delta,
                )
            )  # fmt: skip
        finished = all(s.request.is_finished for s in group.seqs)
        first = group.seqs[0].request
        metrics = RequestMetrics(
            arrival_time=group.arrival, first_scheduled_time=getattr(first, "first_scheduled_time", None),
            first_token_time=min((s.request.first_token_time for s in group.seqs if s.request.first_token_time),
                                 default=None),
            finish_time=max((s.request.finish_time or 0 for s in group.seqs), default=None) if finished else None,
            num_prompt_tokens=len(group.prompt_ids),
            num_generation_tokens=sum(s.request.num_output_tokens for s in group.seqs),
            num_cached_tokens=first.num_cached_tokens,
        )  # fmt: skip
        if finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                self._seq_of.pop(s.request.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished,
                             group.prompt_logprobs, metrics)  # fmt: skip
