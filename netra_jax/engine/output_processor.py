"""Output processor: turns a step's sampled tokens into user-visible results: grammar advance, incremental
detokenization, stop strings, sample (raw and processed) and prompt logprobs, and vLLM-shaped RequestOutputs with
deltas and metrics."""

from __future__ import annotations

import logging

import numpy as np

from netra_jax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from netra_jax.engine.request import RequestStatus
from netra_jax.engine.request_state import RequestState, SampleState
from netra_jax.engine.scheduler import Scheduler
from netra_jax.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    """Host-side bookkeeping after the scheduler has appended a step's tokens; finishes requests in the
    scheduler when a stop string matches or a grammar completes (or breaks)."""

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler

    def _decoded(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _logprob_entry(self, token: int, logprob: float, rank, top_ids: np.ndarray, top_lps: np.ndarray, k: int):
        """{token: Logprob} of the chosen token (rank None: taken from the top k if it is there) plus the top k."""
        entry = {token: Logprob(float(logprob), rank, self._decoded(token))}
        for r in range(k):
            tid = int(top_ids[r])
            if tid == token and rank is None:
                entry[token].rank = r + 1
            entry.setdefault(tid, Logprob(float(top_lps[r]), r + 1, self._decoded(tid)))
        return entry

    def record_prompt_logprob(self, state: RequestState, position: int, lp, rank, top_ids, top_lps) -> None:
        """Prompt position `position` predicted the next prompt token with logprob `lp` at `rank`."""
        token = state.prompt_ids[position + 1]
        k = state.params.prompt_logprobs or 0
        state.prompt_logprobs[position + 1] = self._logprob_entry(token, lp, int(rank), top_ids, top_lps, k)

    def append_token(self, sample: SampleState, token: int, logprobs: tuple | None, last: bool = True) -> bool:
        """A token the scheduler appended to `sample`: advance its grammar, detokenize it, record its logprobs
        (logprobs: (raw lp, top ids [K], top raw logprobs [K], processed lp, k) when the request asked) and apply
        stop strings.
        `last`: the newest of the tokens the scheduler appended this step (a verified proposal appends several; only
        the newest can be the one that ended the request). Returns True when a stop string or the grammar ended the
        request at this token (the caller drops any later tokens of the step)."""
        req = sample.request
        sp = req.sampling_params
        finished_before = req.is_finished  # by the scheduler, at the newest token
        if sample.grammar is not None:
            self._advance_grammar(sample, token)
        ended_here = req.is_finished and not finished_before
        sample.tokens_emitted = req.num_output_tokens
        stopped_by_token = last and req.status is RequestStatus.FINISHED_STOPPED and not sp.include_stop_str_in_output
        hide = stopped_by_token and (token in req.eos_token_ids or token in sp.stop_token_ids)
        new_text = "" if hide else sample.detok.push([token])  # the ending EOS / stop token is not text (vLLM)
        if req.is_finished and (last or ended_here):
            new_text += sample.detok.flush()
        if logprobs is not None and sample.logprobs is not None:
            lp, top_ids, top_lps, processed, k = logprobs
            sample.logprobs.append(self._logprob_entry(token, lp, None, top_ids, top_lps, k))
            sample.cumulative_logprob += float(lp)
            sample.raw_logprobs.append(float(lp))  # float32 values, exactly
            sample.processed_logprobs.append(float(processed))
        sample.text += new_text
        if sp.stop and self._check_stop_strings(sample, len(new_text), already_finished=req.is_finished):
            return True
        return ended_here

    def _advance_grammar(self, sample: SampleState, token: int) -> None:
        """Feed the sampled token to the sample's grammar; finish the request with "stop" once the grammar is
        complete, or with "error" if the token broke it (a mask that allowed nothing)."""
        req = sample.request
        ok = sample.grammar.accept(token)
        if req.is_finished:
            return
        if not ok:
            err = (sample.grammar.error or "")[:300]
            log.warning("request %s: token %d rejected by its grammar: %s", req.request_id, token, err)
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        elif sample.grammar.done:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _check_stop_strings(self, sample: SampleState, n_new: int, already_finished: bool) -> bool:
        """Cut the text at the first stop string in its new part and finish the request; True if one matched."""
        sp = sample.request.sampling_params
        if n_new == 0:
            return False
        longest = max(len(s) for s in sp.stop)
        start = max(0, len(sample.text) - n_new - longest + 1)
        best = None
        for s in sp.stop:
            j = sample.text.find(s, start)
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return False
        j, s = best
        sample.text = sample.text[: j + len(s)] if sp.include_stop_str_in_output else sample.text[:j]
        req = sample.request
        if already_finished:
            req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED_STOPPED, "stop", s
        else:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, s)
        return True

    def output(self, state: RequestState) -> RequestOutput:
        """The request's RequestOutput now: every sample's text so far (a possible partial stop string held back
        while it runs) and the delta since the previous output."""
        outs = [self._completion(sample) for sample in state.samples]
        samples = [s.request for s in state.samples]
        finished = all(r.is_finished for r in samples)
        first = samples[0]
        metrics = RequestMetrics(
            arrival_time=state.arrival,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((r.first_token_time for r in samples if r.first_token_time), default=None),
            finish_time=max((r.finish_time or 0 for r in samples), default=None) if finished else None,
            num_prompt_tokens=len(state.prompt_ids),
            num_generation_tokens=sum(r.num_output_tokens for r in samples),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_ids, outs, finished, _complete(state), metrics
        )

    def _completion(self, sample: SampleState) -> CompletionOutput:
        req = sample.request
        sp = req.sampling_params
        done = req.is_finished
        hold = 0 if done or not sp.stop else max(len(s) for s in sp.stop) - 1
        visible = max(sample.emitted, len(sample.text) - hold)
        delta = sample.text[sample.emitted : visible]
        sample.emitted = visible
        return CompletionOutput(
            index=sample.index,
            text=sample.text[:visible],
            token_ids=list(req.output_token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs,
            raw_logprobs=None if sample.raw_logprobs is None else list(sample.raw_logprobs),
            processed_logprobs=None if sample.processed_logprobs is None else list(sample.processed_logprobs),
            finish_reason=req.finish_reason if done else None,
            stop_reason=req.stop_reason if done else None,
            delta_text=delta,
        )


def _complete(state: RequestState) -> list | None:
    """A copy of the prompt logprobs once every wanted row is in, else None: with n > 1 a sibling may stream tokens
    while the sample that computes the prompt's rows is still in its chunked prefill."""
    lps = state.prompt_logprobs
    if lps is None or any(e is None for e in lps[state.prompt_logprobs_from :]):
        return None
    return list(lps)
