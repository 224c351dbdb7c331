"""Input processor: validates a request's SamplingParams and prompt, tokenizes it, applies the context-length
rule, compiles its grammar and fans n samples out into scheduler Requests (their seeds fixed here)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from netra_jax.engine.request import Request, check_context_length
from netra_jax.engine.request_state import RequestState, SampleState
from netra_jax.sampling_params import SamplingParams
from netra_jax.structured_output import StructuredOutputs
from netra_jax.tokenization.detokenizer import IncrementalDetokenizer
from netra_jax.tokenization.tokenizer import Tokenizer

PromptType = str | Sequence[int] | dict[str, Any]


class InputProcessor:
    """Turns (request id, prompt, params) into a RequestState whose samples are ready for the scheduler. Raises
    ValueError for bad input; touches no engine state."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        max_waiting: int | None = None,
        seed: int = 0,
        max_logprobs: int = 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs  # the most logprobs / prompt_logprobs a request may ask for
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(tokenizer.eos_token_ids or eos_token_ids)
        self.max_waiting = max_waiting
        self.structured = StructuredOutputs(tokenizer, vocab_size, eos_token_ids)
        self._rng = random.Random(seed)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_logprobs_from: int = 1,
    ) -> RequestState:
        """The request's state with its samples. `prompt_logprobs_from`: the first prompt token whose logprob is
        computed (with prompt logprobs; the tokens before it are context, whose blocks prefix-cache hits may give)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size, self.max_logprobs)
        if self.max_waiting is not None and params.n > self.max_waiting:  # else "queue full" forever
            raise ValueError(f"n={params.n} samples can never fit the waiting queue (max_waiting {self.max_waiting})")
        text, ids = self.prompt_ids(prompt)
        check_context_length(len(ids), params.max_tokens, self.max_model_len)
        grammar = self.structured.matcher(params.structured_outputs) if params.structured_outputs else None
        arrival = arrival_time or time.time()
        state = RequestState(request_id, text, ids, params, arrival=arrival, prompt_logprobs_from=prompt_logprobs_from)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(ids)  # filled by the prefill steps
        want_logprobs = params.logprobs is not None
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = (params.seed + i) if params.seed is not None else self._rng.getrandbits(31)
            # only the first sample computes the prompt's logprob rows; its siblings share its cached blocks
            sp = params.clone(seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            req = Request(
                rid,
                ids,
                sp,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                prompt_logprobs_from=prompt_logprobs_from,
            )
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
            sample = SampleState(
                req,
                i,
                detok,
                logprobs=[] if want_logprobs else None,
                cumulative_logprob=0.0 if want_logprobs else None,
                raw_logprobs=[] if want_logprobs else None,
                processed_logprobs=[] if want_logprobs else None,
            )
            sample.grammar = grammar.copy() if grammar is not None and i else grammar
            state.samples.append(sample)
        return state

    def prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: text, token ids, or a dict with "prompt" / "prompt_token_ids"."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, self.check_ids(prompt)

    def check_ids(self, ids) -> list[int]:
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
