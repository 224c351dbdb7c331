"""Per-request sampling parameters with vLLM-compatible names and defaults, and their validation.
Validation happens once on the host so a bad request is refused with a clear message instead of reaching the engine."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0
GREEDY_EPS = 1e-5  # temperatures below this sample greedily


class SamplingType(enum.Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    RANDOM_SEED = "random_seed"


@dataclass
class StructuredOutputsParams:
    """Guided decoding (vLLM's names): exactly one of a JSON schema (`json`, a dict or its JSON text), any JSON object
    (`json_object=True`), a regular expression, a list of `choice` strings, or a Lark `grammar`. The output is forced
    to match it; the request ends with finish_reason "stop" once the grammar is complete."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> StructuredOutputsParams:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object), got {type(self.json).__name__}")
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise ValueError(f"structured_outputs.{k} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        return self


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. `max_tokens=None` means up to the context limit.
    `top_k` 0 or -1 disables top-k; `stop` is normalised to a list of strings, `stop_token_ids` to a list."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            # JSON objects carry string keys ("50256": -100); accept those that spell an integer
            self.logit_bias = {_bias_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int, max_logprobs: int = 20) -> SamplingParams:
        """Raise ValueError naming the first invalid field; return self so calls can be chained."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_float("temperature", self.temperature, 0.0, math.inf, "must be >= 0 and finite")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        self._check_float("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}")
        self._check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be in [-2, 2]")
        self._check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be in [-2, 2]")
        self._validate_logit_bias(vocab_size)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self._validate_stop(vocab_size)
        if not _is_int(max_logprobs) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {max_logprobs!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and _is_int(v) and v > max_logprobs:
                raise ValueError(
                    f"{name} must be at most the engine's max_logprobs of {max_logprobs} (LLM(max_logprobs=...), "
                    f"--max-logprobs), got {v}"
                )
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an integer in [0, {max_logprobs}] or None, got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
            so.validate()
        return self

    @staticmethod
    def _check_float(name: str, v: object, lo: float, hi: float, rule: str) -> None:
        if not _is_number(v) or not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"{name} {rule}, got {v!r}")

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")
        for k, v in self.logit_bias.items():
            if not _is_int(k) or not 0 <= k < vocab_size:
                raise ValueError(f"logit_bias token id {k!r} is outside the vocabulary [0, {vocab_size})")
            if not _is_number(v) or not math.isfinite(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias value for token {k} must be in [-100, 100], got {v!r}")

    def _validate_stop(self, vocab_size: int) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t!r} is outside the vocabulary [0, {vocab_size})")

    # ------------------------------------------------------------------ derived
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with fresh lists/dicts (and `changes` applied), e.g. one per sibling of an n > 1 request."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        fields["stop"] = list(self.stop or [])
        fields["stop_token_ids"] = list(self.stop_token_ids or [])
        fields["logit_bias"] = dict(self.logit_bias) if self.logit_bias is not None else None
        fields.update(changes)
        return SamplingParams(**fields)


def _bias_key(k: object) -> object:
    if isinstance(k, str):
        try:
            return int(k.strip())
        except ValueError:
            return k  # left for validate() to reject with the offending key in the message
    return k
