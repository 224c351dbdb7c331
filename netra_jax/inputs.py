"""Prompt types of the Python API with vLLM's names: a prompt is text, token ids, a TextPrompt or a TokensPrompt
(plain dicts, so `{"prompt_token_ids": [...]}` works as well as `TokensPrompt(prompt_token_ids=[...])`)."""

from __future__ import annotations

from typing import Required, TypedDict

from netra_jax.engine.input_processor import PromptType

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer (special tokens added as it does)."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids, used as they are; `prompt`, when given, is its text as the outputs report it."""

    prompt_token_ids: Required[list[int]]
    prompt: str
