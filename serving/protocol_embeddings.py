"""Pydantic schemas of POST /v1/embeddings: OpenAI's request (input, model, dimensions, encoding_format, user) with
vLLM's extras, and the response (a list of embeddings, float or base64, with usage); strict as protocol.py's."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from netra_jax.serving.protocol import UsageInfo, _Out, _Strict

__all__ = ["MAX_EMBEDDING_INPUTS", "EmbeddingData", "EmbeddingRequest", "EmbeddingResponse"]

MAX_EMBEDDING_INPUTS = 2048  # inputs in one request (OpenAI's limit)


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request; `input` is a string, a list of strings, token ids or a list of token-id lists."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None  # optional here: the one served model is meant
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first n values, normalized again
    user: str | None = None  # accepted and ignored
    # vLLM extras
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k tokens (-1: the context)
    add_special_tokens: bool = True  # for text inputs (Qwen3-Embedding's tokenizer appends <|endoftext|>)
    normalize: bool | None = None  # vLLM's (older) name of use_activation: L2-normalize; None = the model's
    use_activation: bool | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # base64: the dtype of the bytes
    endianness: Literal["native", "little", "big"] = "native"  # base64: the byte order
    request_id: str | None = None  # the response id is "embd-<request_id>"
    priority: int = 0  # lower is embedded first when requests queue up


class EmbeddingData(_Out):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the little-endian (by default) float32 bytes


class EmbeddingResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
