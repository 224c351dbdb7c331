"""Pydantic schemas of POST /v1/score (vLLM's pairs of texts) and the rerank routes (vLLM's, Jina's and Cohere's
`query` + `documents`, and Cohere v2's `meta`): requests strict as protocol.py's, responses as vLLM answers them."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import ConfigDict, Field

from netra_jax.serving.protocol import UsageInfo, _opt, _Out, _Strict

__all__ = [
    "SCORE_PAIRS",
    "RerankApiVersion",
    "RerankDocument",
    "RerankMeta",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "RerankTokens",
    "RerankUsage",
    "RerankV2Response",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
]

# The names vLLM accepts for the two sides of /v1/score, one pair per request (text_1/text_2 is the original one).
SCORE_PAIRS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
ScoreTexts = list[str] | str  # a list of texts, or one (the list first: a bad list item is the error reported)


class _ScoringOptions(_Strict):
    """What /v1/score and the rerank routes share (vLLM's pooling request fields that apply to text scoring)."""

    model: str | None = None  # optional here: the one served model is meant
    user: str | None = None  # accepted and ignored
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # each text keeps its last k tokens (-1: context)
    use_activation: bool | None = None  # vLLM's; normalizing does not change a cosine, so no effect here
    request_id: str | None = None  # the response id is "score-<request_id>" / "rerank-<request_id>"
    priority: int = 0  # lower is embedded first when requests queue up


class ScoreRequest(_ScoringOptions):
    """vLLM's score request: two sides of texts, paired 1:1, 1:N (one text against each of the other side) or N:N
    (equal lengths, the i-th with the i-th), under one pair of names of SCORE_PAIRS."""

    model_config = ConfigDict(
        json_schema_extra={"anyOf": [{"required": list(pair)} for pair in SCORE_PAIRS]},
    )

    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    data_1: ScoreTexts | None = None  # vLLM's newer names for text_1 / text_2
    data_2: ScoreTexts | None = None
    queries: ScoreTexts | None = None  # with `documents` or `items`
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None


class RerankDocument(_Strict):
    """A document as Jina's and Cohere's requests may send it, and as a rerank result returns it."""

    text: str


class RerankRequest(_ScoringOptions):
    """Jina's / Cohere's rerank request, as vLLM takes it: `documents` are strings or `{"text": ...}` objects."""

    query: str
    documents: list[str | RerankDocument] | str  # one string too (as vLLM)
    top_n: int | None = Field(default=None, ge=0)  # the best n results; 0 or absent: all of them
    return_documents: bool = True  # each result carries its document's text (vLLM always returns it)


# ---------------------------------------------------------------------------------------------------- responses
class ScoreData(_Out):
    index: int  # the pair's index
    object: Literal["score"] = "score"
    score: float  # the cosine similarity of the pair's embeddings, in [-1, 1]


class ScoreResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo  # the tokens embedded: each distinct text once


class RerankResult(_Out):
    index: int  # the document's index in the request
    relevance_score: float  # the cosine similarity of the query's and the document's embeddings
    document: RerankDocument | None = _opt()  # left out with return_documents: false


class RerankUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Out):
    """vLLM's (and Jina's) rerank answer: the results by descending relevance_score."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class RerankApiVersion(_Out):
    version: str = "2"


class RerankTokens(_Out):
    input_tokens: int
    output_tokens: int = 0


class RerankMeta(_Out):
    api_version: RerankApiVersion = Field(default_factory=RerankApiVersion)
    tokens: RerankTokens


class RerankV2Response(RerankResponse):
    """/v2/rerank: vLLM's answer with Cohere v2's `meta` (api_version, tokens) added."""

    meta: RerankMeta
