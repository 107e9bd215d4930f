"""User-facing outputs of pooling models (vLLM's `PoolingRequestOutput`, `EmbeddingRequestOutput`,
`ScoringRequestOutput` and their `*Output` parts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch


@dataclass
class PoolingOutput:
    """data: the pooled hidden states, float32 on the CPU: [hidden] (task "embed") or
    [num_prompt_tokens, hidden] (task "token_embed")."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    """embedding: one vector per prompt (task "embed")."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError("an embedding is one vector per prompt: use encode() for "
                             "token_embed outputs")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """score: the similarity of a pair of texts (cosine similarity of their embeddings)."""

    score: float


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """The output of one pooling request (always finished: pooling is one prefill)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, request_output: PoolingRequestOutput[PoolingOutput],
                  ) -> EmbeddingRequestOutput:
        return cls(request_output.request_id, EmbeddingOutput.from_base(request_output.outputs),
                   request_output.prompt_token_ids, request_output.num_cached_tokens,
                   request_output.finished)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
