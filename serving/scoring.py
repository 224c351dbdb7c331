"""POST /v1/score and the rerank routes for a model served with `--task embed`, as vLLM scores with an embedding
model: every distinct text of a request embedded once, through the embeddings' batcher, and each pair scored by the
cosine similarity of its two embeddings.

The routes live in serving/app.py (body parsing, the model name, readiness) and call `embeddings.check_task`, then
`create_scores` or `create_rerank`; texts are tokenized and checked against the context as /v1/embeddings does."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from netra_jax.engine.async_engine import AsyncEngine, EngineDeadError
from netra_jax.engine.engine import LLMEngine
from netra_jax.engine.request_queue import check_priority
from netra_jax.pooling import PoolingError, PoolingParams, embedding_prompt_ids, finish_embeddings
from netra_jax.serving.embeddings import batcher_of
from netra_jax.serving.errors import APIError, bad
from netra_jax.serving.preprocess import prompt_items, response_id
from netra_jax.serving.protocol import UsageInfo
from netra_jax.serving.protocol_embeddings import MAX_EMBEDDING_INPUTS
from netra_jax.serving.protocol_scoring import (
    SCORE_PAIRS,
    RerankDocument,
    RerankMeta,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankTokens,
    RerankUsage,
    RerankV2Response,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)

__all__ = ["create_rerank", "create_scores", "score_sides"]

_SIDE_FIELDS = tuple(dict.fromkeys(name for pair in SCORE_PAIRS for name in pair))  # each name once, in order


def score_sides(req: ScoreRequest) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
    """The two sides of a score request as (field name, texts), from the one pair of names it uses, checked for
    vLLM's pairings (1:1, 1:N, N:N). APIError(400) otherwise."""
    given = [name for name in _SIDE_FIELDS if getattr(req, name) is not None]
    pair = next((p for p in SCORE_PAIRS if set(p) <= set(given)), None)
    if pair is None:
        partners = [b if a in given else a for a, b in SCORE_PAIRS if a in given or b in given]
        missing = partners[0] if partners else "text_1"  # the partner of the first field given
        names = ", ".join(f"{a} and {b}" for a, b in SCORE_PAIRS)
        raise bad(f"missing field {missing}: give the texts to score as one of {names}", missing)
    extra = [name for name in given if name not in pair]
    if extra:
        raise bad(f"{extra[0]} is not allowed with {pair[0]} and {pair[1]}: give one pair of texts to score", extra[0])
    name_1, name_2 = pair
    side_1 = prompt_items(getattr(req, name_1), name_1, MAX_EMBEDDING_INPUTS, "texts")
    side_2 = prompt_items(getattr(req, name_2), name_2, MAX_EMBEDDING_INPUTS, "texts")
    if len(side_1) > 1 and len(side_1) != len(side_2):
        raise bad(
            f"{name_1} and {name_2} pair 1:1, 1:N or N:N; got {len(side_1)} and {len(side_2)} texts (N:N needs as "
            "many of each)",
            name_2,
        )
    return (name_1, side_1), (name_2, side_2)


@dataclass
class _Texts:
    """The distinct texts of one request in first-seen order, each with the field and position first giving it."""

    texts: list[str] = field(default_factory=list)
    origins: list[tuple[str, str]] = field(default_factory=list)  # (param, e.g. "documents[2]")
    _rows: dict[str, int] = field(default_factory=dict)

    def row(self, text: str, param: str, where: str) -> int:
        """The row of `text` in the request's embeddings (added when new)."""
        if text not in self._rows:
            self._rows[text] = len(self.texts)
            self.texts.append(text)
            self.origins.append((param, where))
        return self._rows[text]

    def rows(self, texts: list[str], param: str) -> np.ndarray:
        """The rows of a side's texts: [len(texts)] int."""
        where = [param] if len(texts) == 1 else [f"{param}[{i}]" for i in range(len(texts))]
        return np.array([self.row(t, param, w) for t, w in zip(texts, where, strict=True)], dtype=np.int64)


def _prompts(llm: LLMEngine, texts: _Texts, truncate_prompt_tokens: int | None) -> list[list[int]]:
    """The token ids of every distinct text, tokenized as /v1/embeddings tokenizes text (special tokens added),
    truncated to the last `truncate_prompt_tokens` when asked and checked against the context: the same 400s."""
    try:
        embedding_prompt_ids([0], llm.max_model_len, truncate_prompt_tokens)  # one dummy token: checks k alone
    except PoolingError as e:
        raise bad(str(e), "truncate_prompt_tokens") from None
    out = []
    for text, (param, where) in zip(texts.texts, texts.origins, strict=True):
        if not text:
            raise bad(f"{where} must not be an empty string", param)
        ids = llm.tokenizer.encode(text, add_special_tokens=True)
        try:
            out.append(embedding_prompt_ids(ids, llm.max_model_len, truncate_prompt_tokens))
        except PoolingError as e:  # empty after tokenizing, or longer than the context
            raise bad(f"{where}: {e}", param) from None
    return out


async def _embed(engine: AsyncEngine, texts: _Texts, req: ScoreRequest | RerankRequest) -> tuple[np.ndarray, int]:
    """The unit-length embeddings of the request's distinct texts, [len(texts.texts), hidden] float32, computed in
    one batcher call (pooled with concurrent /v1/embeddings requests), and the number of tokens embedded."""
    llm = engine.engine
    try:
        check_priority(req.priority, llm.config.scheduler.scheduling_policy)  # as the other routes
    except ValueError as e:
        raise bad(str(e), "priority") from None
    prompts = await asyncio.to_thread(_prompts, llm, texts, req.truncate_prompt_tokens)  # off the event loop
    try:
        pooled = await batcher_of(engine).embed(prompts, req.priority)  # [n, hidden]
    except EngineDeadError as e:
        raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None
    unit = finish_embeddings(pooled, PoolingParams(use_activation=True), llm.pooling)  # [n, hidden], L2 norm 1
    return unit, sum(map(len, prompts))


def _cosines(unit: np.ndarray, rows_1: np.ndarray, rows_2: np.ndarray) -> np.ndarray:
    """Cosine similarity of the pairs (rows_1[i], rows_2[i]) of unit embeddings [n, hidden]: [pairs] float32, clipped
    to [-1, 1] (rounding can put a text's similarity with itself a hair above 1)."""
    return np.clip(np.einsum("pd,pd->p", unit[rows_1], unit[rows_2]), -1.0, 1.0)


async def create_scores(engine: AsyncEngine, model_name: str, req: ScoreRequest) -> ScoreResponse:
    """/v1/score's response to a validated request (the route has checked the model name, the task and readiness):
    one score per pair, in pair order; a single text on the first side is paired with each text of the second."""
    (name_1, side_1), (name_2, side_2) = score_sides(req)
    texts = _Texts()
    rows_1, rows_2 = texts.rows(side_1, name_1), texts.rows(side_2, name_2)  # [1 or N], [N]
    unit, tokens = await _embed(engine, texts, req)
    scores = _cosines(unit, np.broadcast_to(rows_1, rows_2.shape), rows_2)  # [N]
    return ScoreResponse(
        id=response_id("score", req),
        model=model_name,
        data=[ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)],
        usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
    )


async def create_rerank(
    engine: AsyncEngine, model_name: str, req: RerankRequest, cohere_v2: bool = False
) -> RerankResponse | RerankV2Response:
    """The rerank routes' response to a validated request: each document scored against the query, the results by
    descending relevance_score (ties in document order), the best `top_n` of them (all when 0 or absent); with
    `cohere_v2` (/v2/rerank) Cohere's `meta` too."""
    docs = [req.documents] if isinstance(req.documents, str) else req.documents
    docs = prompt_items([d if isinstance(d, str) else d.text for d in docs], "documents", MAX_EMBEDDING_INPUTS, "texts")
    texts = _Texts()
    query_row = texts.row(req.query, "query", "query")
    doc_rows = texts.rows(docs, "documents")  # [n]
    unit, tokens = await _embed(engine, texts, req)
    scores = _cosines(unit, np.full_like(doc_rows, query_row), doc_rows)  # [n]
    order = np.argsort(-scores, kind="stable")[: req.top_n or None]  # [top_n]: best first
    results = [
        RerankResult(
            index=int(i),
            relevance_score=float(scores[i]),
            document=RerankDocument(text=docs[i]) if req.return_documents else None,
        )
        for i in order
    ]
    fields = dict(
        id=response_id("rerank", req),
        model=model_name,
        usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        results=results,
    )
    if cohere_v2:
        return RerankV2Response(**fields, meta=RerankMeta(tokens=RerankTokens(input_tokens=tokens)))
    return RerankResponse(**fields)
