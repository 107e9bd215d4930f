"""Request and response bodies of the pooling routes (vLLM's shapes): /v1/embeddings (OpenAI's
embeddings API), /pooling, /score (and /v1/score), /rerank (and /v1/rerank, Jina/Cohere style)."""

from __future__ import annotations

import time
from typing import Annotated, Literal, Optional, Union

from pydantic import Field

from pyorch.entrypoints.openai.protocol import MAX_PROMPTS, OpenAIBaseModel

# Text fields are bounded by the body limit and the prompt-length check; lists by MAX_PROMPTS.
_TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]], Field(min_length=1)]
PoolingInput = Union[
    str,
    Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
    _TokenIds,
    Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    # vLLM's extras
    normalize: Optional[bool] = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)


class PoolingRequest(EmbeddingRequest):
    """/pooling: like /v1/embeddings, with the pooling task ("embed": one vector per input,
    "token_embed": one per token; default: the server's, from --pooler-config)."""

    task: Optional[Literal["embed", "token_embed"]] = None


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], list[list[float]], str]


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


_Texts = Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]]


class ScoreRequest(OpenAIBaseModel):
    """Pairs text_1 x text_2: 1 -> 1, 1 -> N or N -> N."""

    model: Optional[str] = None
    text_1: _Texts
    text_2: _Texts
    normalize: Optional[bool] = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(OpenAIBaseModel):
    model: Optional[str] = None
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    top_n: int = Field(0, ge=0)  # 0: every document
    normalize: Optional[bool] = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
