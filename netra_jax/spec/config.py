"""Speculative decoding settings, vLLM's `speculative_config`: n-gram prompt lookup or a draft model proposes up
to k tokens per step, the target verifies them in its ordinary step."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from netra_jax.config import ConfigError, json_object

SPEC_METHODS = ("ngram", "draft_model")
_DEFAULT_LOOKUP = 5  # vLLM's n-gram window when neither bound is given
# Proposals stop while more requests than this run, unless the config says otherwise (None: never stop). On 2 CPU
# cores (SmolLM2, n-gram k 5) speculation gained 1.49x at 1 request on grounded prompts and 1.18x on free-form chat,
# and at 8 requests 1.13x on grounded prompts but 0.93x on chat: each verification widens a step that already costs
# about in proportion to its tokens (benchmarks/results/2026-12-02-spec_decode_batch*.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": the proposal is the k tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). method "draft_model": `model`
    (same tokenizer as the target) proposes k tokens greedily. disable_by_batch_size: no proposals while more
    requests than this are running (vLLM's option; default DEFAULT_DISABLE_BY_BATCH_SIZE, where vLLM's is None;
    None, or null in JSON: always speculate)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
            if self.model is not None:
                raise ConfigError("method 'ngram' takes no draft model; give {'model': path} for a draft model")
        elif not self.model:
            raise ConfigError("method 'draft_model' needs 'model': the path of a draft checkpoint")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(f"disable_by_batch_size must be a positive integer or None, got {d!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m} or {"model": path, "num_speculative_tokens": k} (method "draft_model" implied).
        One lookup bound given alone sets both, as vLLM does. Unknown keys raise ConfigError."""
        d = json_object(d, "speculative config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        kw = dict(d)
        if "num_speculative_tokens" not in kw:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        if kw.get("method") is None:
            kw["method"] = "draft_model" if kw.get("model") else "ngram"
        lo, hi = kw.get("prompt_lookup_min"), kw.get("prompt_lookup_max")
        if lo is None and hi is not None:
            kw["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            kw["prompt_lookup_max"] = lo
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if kw.get(key) is None:
                kw.pop(key, None)
        return cls(**kw)


def speculative_config_from(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from what users pass: the object, vLLM's dict, its JSON text (the CLI flag), or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_dict(json_object(value, "speculative config"))
