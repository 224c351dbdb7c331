"""Continuous-batching scheduler: each step gives requests new tokens so num_computed_tokens catches up to
num_tokens (prefill, chunked prefill, decode and prefix hits are one rule); preempts by recompute when KV runs out.
Steps may overlap: a request can be scheduled again before its previous step's sampled token is known."""

from __future__ import annotations

import time
from collections.abc import Callable

from netra_jax.engine.block_pool import BlockPool, chain_hashes
from netra_jax.engine.buckets import fit_chunk, token_buckets
from netra_jax.engine.request import Request, RequestStatus, check_context_length
from netra_jax.engine.request_queue import check_priority, make_waiting_queue
from netra_jax.engine.sched_output import PROMPT_LOGPROB_ROWS, ScheduledRequest, SchedulerOutput, prompt_logprob_rows
from netra_jax.engine_config import SchedulerConfig

__all__ = [
    "PROMPT_LOGPROB_ROWS",
    "QueueFullError",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "prompt_logprob_rows",
]


class QueueFullError(RuntimeError):
    """The waiting queue is at `SchedulerConfig.max_waiting`; the caller should retry later."""


class Scheduler:
    """Running requests are served first (in admission order), then waiting ones in the policy's order (arrival, or
    priority then arrival) while the token budget, `max_num_seqs` and the pool allow. When a running request cannot
    get a block, the policy's victim is preempted (blocks freed, recomputed later from prompt + output): the most
    recently admitted request (fcfs) or the lowest-priority one (priority). Under "priority" a waiting request that
    finds no room also preempts a running request of strictly lower priority (larger value). With LoRA adapters, a
    waiting request whose adapter would be one more than `max_loras` distinct running ones waits (others pass it)."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, max_model_len: int) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if config.max_waiting is not None and config.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {config.max_waiting}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.block_size = pool.block_size
        self._waiting = make_waiting_queue(config.scheduling_policy)
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self._prompt_rows_left = PROMPT_LOGPROB_ROWS  # of the step being scheduled
        self.step_token_limit: int | None = None  # see limit_step_tokens
        self._hold: Callable[[Request], bool] | None = None  # see hold_waiting

    # ------------------------------------------------------------------ queries
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> list[Request]:
        """The running requests in service order (a copy)."""
        return list(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> dict[str, float]:
        p = self.pool
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_preemptions": self.num_preemptions,
            "kv_usage": p.usage,
            "prefix_hits_tokens": p.prefix_hits_tokens,
            "prefix_queries_tokens": p.prefix_queries_tokens,
            "prefix_hit_rate": p.prefix_hit_rate,
        }

    # ------------------------------------------------------------------ admission
    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises ValueError when it can never fit (max_model_len or the whole KV pool),
        QueueFullError when the waiting queue is at its cap."""
        if not isinstance(req, Request):
            raise ValueError(f"expected a Request, got {type(req).__name__}")
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens or req.block_ids:
            raise ValueError(f"request {req.request_id!r} was already scheduled (status {req.status.name})")
        check_priority(req.priority, self._waiting.policy)
        cap = self.config.max_waiting
        if cap is not None and len(self._waiting) >= cap:
            raise QueueFullError(f"waiting queue is full ({cap} requests)")
        req.max_total_tokens = self._token_limit(req)
        self._requests[req.request_id] = req
        self._waiting.add(req)

    def _token_limit(self, req: Request) -> int:
        p, mt, bs = req.num_tokens, req.sampling_params.max_tokens, self.block_size
        kv_tokens = self.pool.num_total * bs  # the last generated token never needs a KV slot
        if mt is None:
            check_context_length(p, None, self.max_model_len)
            limit = min(self.max_model_len, kv_tokens + 1)
            if p >= limit:
                raise ValueError(
                    f"request {req.request_id!r}: prompt of {p} tokens leaves no room to generate (limit {limit} "
                    f"tokens: max_model_len {self.max_model_len}, KV cache {kv_tokens} tokens)"
                )
            return limit
        if not isinstance(mt, int) or mt < 1:
            raise ValueError(f"request {req.request_id!r}: max_tokens must be a positive integer, got {mt!r}")
        check_context_length(p, mt, self.max_model_len)
        total = p + mt
        if total - 1 > kv_tokens:
            raise ValueError(
                f"request {req.request_id!r}: prompt ({p} tokens) + max_tokens ({mt}) needs "
                f"{self.pool.blocks_needed(total - 1)} KV blocks of {bs} tokens, the cache has {self.pool.num_total}"
            )
        return total

    # ------------------------------------------------------------------ scheduling
    def limit_step_tokens(self, limit: int | None) -> None:
        """Hold steps to at most `limit` tokens (None: `max_num_batched_tokens`), below the token budget: while the
        engine's larger step programs are still compiling, prompts are chunked to what the compiled ones hold."""
        if limit is not None and limit < 1:
            raise ValueError(f"a step token limit must be positive, got {limit}")
        self.step_token_limit = limit

    def hold_waiting(self, hold: Callable[[Request], bool] | None) -> None:
        """While set, waiting requests for which `hold(request)` is true stay in the queue (those behind them are
        admitted): requests that need a program the engine is still compiling wait for it. None: none is held."""
        self._hold = hold

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = min(self.config.max_num_batched_tokens, self.step_token_limit or self.config.max_num_batched_tokens)
        self._prompt_rows_left = PROMPT_LOGPROB_ROWS
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            n = self._chunk(req, req.num_scheduled_end, budget)
            if n <= 0:
                i += 1
                continue
            need = self.pool.blocks_needed(req.num_scheduled_end + n) - len(req.block_ids)
            while need > self.pool.num_free_blocks:
                victim = self._waiting.victim(self._running)
                if self._running.index(victim) < i:  # (priority) already scheduled this step: undone
                    i -= 1
                budget += self._evict(out, victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if need > 0:
                req.block_ids.extend(self.pool.allocate(need))
            out.scheduled.append(self._entry(req, n))
            budget -= n
            i += 1
        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """New tokens to give `req` from `start`: up to the end of its sequence (placeholders included) and its
        proposed tokens, within the token budget (which may cut proposals short), and within the step's
        prompt-logprob rows. 0 when the pending token will end it by length."""
        end = req.num_tokens + req.num_placeholders
        if req.num_placeholders and end >= min(req.max_total_tokens or self.max_model_len, self.max_model_len):
            return 0
        end += len(req.spec_token_ids)
        n = min(end - start, budget)
        rows = prompt_logprob_rows(req, start, n)
        if len(rows) > self._prompt_rows_left:  # up to the last row that fits (context before the rows is free)
            n = rows.start - start + self._prompt_rows_left
        return n

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        pool, bs = self.pool, self.block_size
        caching = pool.enable_prefix_caching
        pending: set[bytes] | None = None  # hashes of full blocks that running requests are still computing
        deferred: list[Request] = []
        while self._waiting and budget > 0:
            req = self._waiting.peek()
            if req.num_placeholders:  # preempted while its last token was in flight: resumes once it is known
                deferred.append(self._waiting.pop())
                continue
            if not self._lora_fits(req):  # every adapter slot is held by running requests of other adapters
                deferred.append(self._waiting.pop())
                continue
            if self._hold is not None and self._hold(req):  # its program is still compiling
                deferred.append(self._waiting.pop())
                continue
            hits: list[int] = []
            limit = self._hit_limit(req) if caching else 0
            if limit:
                hits = pool.get_computed_blocks(req.all_token_ids, req.cache_key, req.block_hashes, record=False)
                hits = hits[:limit]
                k = len(hits)
                if k < limit:  # the next block missed; defer if a running request computes it
                    if pending is None:
                        pending = self._pending_hashes()
                    if req.block_hashes[k] in pending:
                        deferred.append(self._waiting.pop())
                        continue
            num_computed = len(hits) * bs
            n = self._chunk(req, num_computed, budget)
            if n <= 0:
                break
            need = pool.blocks_needed(num_computed + n) - len(hits)
            full = len(self._running) >= self.config.max_num_seqs
            if full or need + pool.num_revived(hits) > pool.num_free_blocks:
                victims = self._victims_making_room(req, hits, need)
                if not victims:
                    break
                for victim in victims:
                    budget += self._evict(out, victim)
                pending = None
                continue
            n = self._fit_last_chunk(out, n, budget)  # (its blocks stay allocated for the whole chunk)
            self._waiting.pop()
            pool.take(hits)
            req.block_ids = hits + pool.allocate(need)
            req.num_computed_tokens = num_computed
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = num_computed
                req.first_scheduled_time = time.time()
                pool.record_prefix_query(req.num_tokens, num_computed)
            req.status = RequestStatus.RUNNING
            self._running.append(req)
            out.scheduled.append(self._entry(req, n))
            budget -= n
            if pending is not None:
                self._add_pending(pending, req)
        self._waiting.prepend(deferred)

    def _lora_fits(self, req: Request) -> bool:
        """Whether `req`'s adapter can run now: the base model always, an adapter when it already runs or fewer than
        `max_loras` distinct adapters do (each needs a device slot; a request never fails for want of one)."""
        if not req.lora_id or self.config.max_loras is None:
            return True
        running = {r.lora_id for r in self._running if r.lora_id}
        return req.lora_id in running or len(running) < self.config.max_loras

    def _hit_limit(self, req: Request) -> int:
        """Full blocks a prefix hit may give `req`: all but the one holding its last token (whose logits are needed),
        and with prompt logprobs none from the one holding the position before `prompt_logprobs_from` on (each
        wanted row must be computed)."""
        limit = (req.num_tokens - 1) // self.block_size
        if req.sampling_params.prompt_logprobs is not None:
            limit = min(limit, (req.prompt_logprobs_from - 1) // self.block_size)
        return limit

    def _fit_last_chunk(self, out: SchedulerOutput, n: int, budget: int) -> int:
        """An admitted request's chunk of n tokens, cut to end the step on a token bucket (buckets.fit_chunk) when
        it is the step's last admission (the budget, the queue or the seats end with it) and the config asks for it."""
        cfg = self.config
        last = budget <= n or len(self._waiting) == 1 or len(self._running) + 1 >= cfg.max_num_seqs
        if not cfg.align_chunks_to_buckets or not last:
            return n
        used = sum(s.num_new_tokens for s in out.scheduled)
        # what the step's requests bring to the next: a decode each where they sample, else the rest of the prompt
        then = sum(1 if s.sample else s.request.num_tokens - s.start - s.num_new_tokens for s in out.scheduled)
        return fit_chunk(used, n, then, token_buckets(cfg.max_num_batched_tokens))

    def _victims_making_room(self, req: Request, hits: list[int], need: int) -> list[Request]:
        """The fewest running requests, in the policy's victim order, whose preemption gives waiting `req` a seat
        and `need` new blocks besides its prefix hits; [] when the policy allows none or all of them would not
        suffice (nothing is preempted in vain). Blocks shared with requests that stay are not counted as freed."""
        pool = self.pool
        seats = len(self._running) - self.config.max_num_seqs + 1  # victims needed for a seat
        free, dropped = pool.num_free_blocks, {}  # block -> references the chosen victims drop
        chosen = []
        for victim in self._waiting.victims_for(req, self._running):
            chosen.append(victim)
            for b in victim.block_ids:
                dropped[b] = dropped.get(b, 0) + 1
                free += dropped[b] == pool.ref_count(b)
            revived = sum(1 for b in hits if pool.ref_count(b) == dropped.get(b, 0))
            if len(chosen) >= seats and need + revived <= free:
                return chosen
        return []

    def _evict(self, out: SchedulerOutput, victim: Request) -> int:
        """Preempt running `victim`, first taking its entry of this step (if any) out of `out`; returns the tokens
        that entry had from the step's budget."""
        self._running.remove(victim)
        freed = 0
        for k, s in enumerate(out.scheduled):
            if s.request is victim:  # undo `_entry` (the in-flight count is dropped by _preempt)
                del out.scheduled[k]
                victim.num_placeholders -= s.sample
                self._prompt_rows_left += len(prompt_logprob_rows(victim, s.start, s.num_new_tokens))
                freed = s.num_new_tokens
                break
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)
        return freed

    def _pending_hashes(self) -> set[bytes]:
        pending: set[bytes] = set()
        for r in self._running:
            self._add_pending(pending, r)
        return pending

    def _add_pending(self, pending: set[bytes], r: Request) -> None:
        # only requests catching up on several tokens (prefill, resumed) are worth waiting for
        if r.num_tokens - r.num_computed_tokens > 1:
            lo, hi = r.num_computed_tokens // self.block_size, r.num_tokens // self.block_size
            if hi > lo:
                hashes = chain_hashes(r.all_token_ids, self.block_size, hi, r.cache_key, r.block_hashes)
                pending.update(hashes[lo:hi])

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        """Schedule n tokens of `req` and count them in flight (the sampled one as a placeholder). Tokens past the
        end of its sequence are its proposed tokens (as many as fit); the proposal is used up either way."""
        start = req.num_scheduled_end
        end = req.num_tokens + req.num_placeholders
        sample = start + n >= end
        spec = req.spec_token_ids[: max(0, start + n - end)]
        req.spec_token_ids = []
        self._prompt_rows_left -= len(prompt_logprob_rows(req, start, n))
        req.num_inflight_tokens += n
        req.num_placeholders += sample
        return ScheduledRequest(req, n, start, list(req.block_ids), sample, req.num_preemptions, spec)

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_inflight_tokens = 0  # that work is lost; a placeholder still in flight is appended when known
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.prepend([req])

    def reserve_slots(self, req: Request, num_tokens: int) -> bool:
        """Extend running `req`'s block table to cover `num_tokens` tokens (lookahead slots a draft model writes
        before the step that verifies its proposal); False, allocating nothing, when the pool is short of blocks."""
        need = self.pool.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    # ------------------------------------------------------------------ results
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance the requests of `out` by what was computed, append sampled tokens to those that sampled, apply
        token-level stop conditions and free finished requests. Returns the requests finished by this update.
        Results of requests finished since `out` was scheduled are dropped; a request preempted since keeps its
        sampled token (drawn from a complete forward) but not the KV progress. A request that verified proposed
        tokens gets its accepted tokens (`sampled[id]`: the accepted drafts, then the target's own token); the KV
        slots of rejected proposals are rolled back by counting them out of num_computed_tokens."""
        live = [s for s in out.scheduled if self._requests.get(s.request_id) is s.request]
        for s in live:
            if s.sample and s.request_id not in sampled:
                raise ValueError(f"no sampled token for request {s.request_id!r}, which sampled this step")
        out.settled = True
        finished = []
        pool = self.pool
        for s in live:
            req = s.request
            tokens = sampled.get(req.request_id) if s.sample else None
            if s.epoch == req.num_preemptions:
                req.num_inflight_tokens -= s.num_new_tokens
                computed = s.num_new_tokens
                known = req.all_token_ids
                if s.spec_token_ids:  # accepted drafts are the first len(tokens) - 1 of them
                    accepted = len(tokens) - 1
                    if not 0 <= accepted <= len(s.spec_token_ids):
                        raise ValueError(f"request {s.request_id!r}: {len(tokens)} tokens for its proposal")
                    computed -= len(s.spec_token_ids) - accepted
                    known = known + list(tokens[:accepted])
                req.num_computed_tokens += computed
                if pool.enable_prefix_caching:
                    pool.cache_full_blocks(
                        known, req.block_ids, req.num_computed_tokens, req.cache_key, req.block_hashes
                    )
            if not s.sample:
                continue
            req.num_placeholders -= 1
            for t in [tokens] if isinstance(tokens, int) else tokens:
                req.append_output(t)
                if req.first_token_time is None:
                    req.first_token_time = time.time()
                stop = self._check_stop(req, req.output_token_ids[-1])
                if stop is not None:
                    self._finish(req, *stop)
                    finished.append(req)
                    break
        return finished

    def cancel(self, out: SchedulerOutput) -> None:
        """Undo the scheduling of a step whose results will never be applied (an error between schedule() and
        update_from_output): its tokens are no longer in flight and its placeholders are dropped, so its requests
        are scheduled again from what was computed (their KV slots are simply written again). No-op once settled."""
        if out.settled:
            return
        out.settled = True
        for s in out.scheduled:
            req = s.request
            if self._requests.get(s.request_id) is not req:  # finished or aborted since
                continue
            if s.epoch == req.num_preemptions:  # (a preemption already dropped the in-flight count)
                req.num_inflight_tokens -= s.num_new_tokens
            req.num_placeholders -= s.sample

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus, int | None] | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in req.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_tokens >= min(req.max_total_tokens or self.max_model_len, self.max_model_len):
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def finish_request(self, request_id: str, status: RequestStatus, reason: str | int | None = None) -> Request | None:
        """Finish a waiting or running request early (a stop string matched, the client left, an error).
        Frees its blocks at once. Returns the request, or None when it is unknown or already finished."""
        if not isinstance(status, RequestStatus) or not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status!r}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, status, reason)
        return req

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus, reason: str | int | None) -> None:
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        req.status = status
        req.finish_reason = status.finish_reason
        req.stop_reason = reason
        req.finish_time = time.time()
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ------------------------------------------------------------------ checks
    def check_invariant(self) -> None:
        """Raise AssertionError unless the pool is consistent and its references are exactly the running
        requests' block tables (waiting and preempted requests hold nothing)."""
        self.pool.check_invariant()
        refs: dict[int, int] = {}
        for r in self._running:
            if r.status is not RequestStatus.RUNNING:
                raise AssertionError(f"{r} is in the running list")
            if len(r.block_ids) < self.pool.blocks_needed(r.num_computed_tokens):
                raise AssertionError(f"{r} has fewer blocks than its computed tokens need")
            for b in r.block_ids:
                refs[b] = refs.get(b, 0) + 1
        for r in self._waiting:
            if r.block_ids or r.num_computed_tokens or r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"waiting {r} holds KV state")
        for b in range(self.pool.num_total):
            if self.pool.ref_count(b) != refs.get(b, 0):
                raise AssertionError(f"block {b} has {self.pool.ref_count(b)} refs, requests hold {refs.get(b, 0)}")
        if len(self._requests) != len(self._running) + len(self._waiting):
            raise AssertionError("request table out of sync with the queues")
