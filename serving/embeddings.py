"""POST /v1/embeddings for a model served with `--task embed`: inputs checked and tokenized, the prompts of
concurrent requests pooled together in one engine call, then truncated / normalized and encoded (float or base64).

The route itself lives in serving/app.py (its body parsing and model / readiness checks) and calls
`create_embeddings`; `check_task` is the 400 a route answers when the server's task is not the one it needs."""

from __future__ import annotations

import asyncio
import base64
import functools
import itertools
import sys
import weakref
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from netra_jax.engine.async_engine import AsyncEngine, EngineDeadError
from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.request_queue import check_priority
from netra_jax.pooling import PoolingError, PoolingParams, embedding_prompt_ids, finish_embeddings
from netra_jax.serving.errors import APIError, bad
from netra_jax.serving.preprocess import prompt_items, response_id
from netra_jax.serving.protocol import UsageInfo
from netra_jax.serving.protocol_embeddings import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
)

__all__ = [
    "EmbeddingBatcher",
    "batcher_of",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "check_task",
    "create_embeddings",
    "encode_embedding",
    "input_prompts",
]

_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def check_task(engine: LLMEngine, wanted: str, route: str = "/v1/embeddings") -> None:
    """APIError(400) when the served model's task is not `wanted` ("generate" or "embed"); `route`: the embedding
    route asked for, named in the message."""
    task = engine.config.task
    if task == wanted:
        return
    if wanted == "embed":
        message = (
            f"this server generates text (--task {task}): {route} needs an embedding model served with "
            "`netra-jax serve MODEL --task embed`"
        )
    else:
        message = (
            f"this server serves embeddings (--task {task}) and does not generate text: use /v1/embeddings, or "
            "serve a generative model with --task generate"
        )
    raise APIError(400, message, code="unsupported_task")


def input_prompts(engine: LLMEngine, req: EmbeddingRequest) -> list[list[int]]:
    """The token ids of every input, each checked against the vocabulary and the context (truncated to the last
    `truncate_prompt_tokens` tokens when asked). APIError(400) on bad input."""
    items = prompt_items(req.input, "input", MAX_EMBEDDING_INPUTS, "inputs")
    out = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input[{i}]"
        try:
            if isinstance(item, str):
                if not item:
                    raise PoolingError("must not be an empty string")
                ids = engine.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            else:
                ids = engine.inputs.check_ids(item)
            out.append(embedding_prompt_ids(ids, engine.max_model_len, req.truncate_prompt_tokens))
        except PoolingError as e:  # a bad truncation is about the field, not the input
            raise bad(f"{where}: {e}" if e.param in (None, "input") else str(e), e.param or "input") from None
        except ValueError as e:  # token ids outside the vocabulary, an empty list
            raise bad(f"{where}: {e}", "input") from None
    return out


def encode_embedding(vector: np.ndarray, req: EmbeddingRequest) -> list[float] | str:
    """One embedding as the response carries it: floats, or base64 of its `embed_dtype` bytes in `endianness`
    order (by default little-endian float32 on the usual hosts, what the openai client decodes)."""
    if req.encoding_format == "float":
        return vector.astype(np.float32).tolist()
    order = {"native": sys.byteorder, "little": "little", "big": "big"}[req.endianness]
    dtype = _DTYPES[req.embed_dtype].newbyteorder("<" if order == "little" else ">")
    return base64.b64encode(vector.astype(dtype).tobytes()).decode("ascii")


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    prompts: list[list[int]] = field(compare=False)
    tokens: int = field(compare=False)
    result: asyncio.Future = field(compare=False)


class EmbeddingBatcher:
    """Pools the prompts of concurrent requests together: while one engine call runs, arriving requests wait and
    the next call takes them all, in (priority, arrival) order, up to one embedding step's tokens (at least one
    request; a large request runs as several steps inside its call)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.max_tokens = engine.engine.embedder.max_tokens
        self._waiting: list[_Job] = []
        self._worker: asyncio.Task | None = None
        self._seq = itertools.count()
        self.num_calls = 0  # engine calls made (fewer than requests when they were batched)

    async def embed(self, prompts: list[list[int]], priority: int = 0) -> np.ndarray:
        """Pooled hidden states of `prompts`: [len(prompts), hidden] float32."""
        loop = asyncio.get_running_loop()
        job = _Job(priority, next(self._seq), prompts, sum(map(len, prompts)), loop.create_future())
        self._waiting.append(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run())
        return await job.result

    def _take(self) -> list[_Job]:
        self._waiting.sort()
        jobs, tokens = [], 0
        while self._waiting and (not jobs or tokens + self._waiting[0].tokens <= self.max_tokens):
            job = self._waiting.pop(0)
            if not job.result.done():  # its client has gone
                jobs.append(job)
                tokens += job.tokens
        return jobs

    async def _run(self) -> None:
        while self._waiting:
            jobs = self._take()
            if not jobs:
                continue
            prompts = [p for job in jobs for p in job.prompts]
            try:
                pooled = await self.engine.call(functools.partial(LLMEngine.embed, prompts=prompts))  # [n, hidden]
            except Exception as e:  # noqa: BLE001 - handed to every waiting request
                for job in jobs:
                    if not job.result.done():
                        job.result.set_exception(e)
                continue
            self.num_calls += 1
            start = 0
            for job in jobs:
                if not job.result.done():
                    job.result.set_result(pooled[start : start + len(job.prompts)])
                start += len(job.prompts)


_BATCHERS: weakref.WeakKeyDictionary[AsyncEngine, EmbeddingBatcher] = weakref.WeakKeyDictionary()


def batcher_of(engine: AsyncEngine) -> EmbeddingBatcher:
    """The one batcher of a served engine."""
    if engine not in _BATCHERS:
        _BATCHERS[engine] = EmbeddingBatcher(engine)
    return _BATCHERS[engine]


async def create_embeddings(engine: AsyncEngine, model_name: str, req: EmbeddingRequest) -> EmbeddingResponse:
    """The response to a validated request (the route has checked the model name, the task and readiness)."""
    llm = engine.engine
    params = PoolingParams(
        dimensions=req.dimensions,
        use_activation=req.use_activation,
        normalize=req.normalize,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    try:
        params.verify(llm.pooling, model_name)
        check_priority(req.priority, llm.config.scheduler.scheduling_policy)  # as the generation routes
    except PoolingError as e:
        raise bad(str(e), e.param) from None
    except ValueError as e:
        raise bad(str(e), "priority") from None
    prompts = await asyncio.to_thread(input_prompts, llm, req)  # tokenizing many inputs: off the event loop
    try:
        pooled = await batcher_of(engine).embed(prompts, req.priority)
    except EngineDeadError as e:
        raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None
    vectors = finish_embeddings(pooled, params, llm.pooling)  # [n, dims]
    tokens = sum(map(len, prompts))
    return EmbeddingResponse(
        id=response_id("embd", req),
        model=model_name,
        data=[EmbeddingData(index=i, embedding=encode_embedding(v, req)) for i, v in enumerate(vectors)],
        usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
    )
