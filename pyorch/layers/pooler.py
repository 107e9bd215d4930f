"""The pooler: turns a pooling request's final hidden states into its output vector(s).

The model runner applies it after the forward pass to the rows of pooling requests (models know
nothing of pooling: their forward already returns the hidden states after the final norm). A
prompt may run in several chunks (chunked prefill, or a preemption that recomputes it), so the
pooler keeps a `PoolingState` per request and folds each chunk into it:
- LAST: the hidden state of the last prompt token (in the last chunk);
- MEAN: a float32 running sum over every prompt position, divided by the prompt length;
- CLS: the hidden state of position 0 (in the first chunk);
- ALL: every position's hidden state (task "token_embed"), chunks concatenated.
When the last chunk has run, `finish` truncates to `dimensions` (matryoshka) and L2-normalizes
if asked, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pyorch.pooling_params import PoolerConfig, PoolingParams


@dataclass
class PoolingState:
    """One request's pooling so far (lives in the model runner while the request runs)."""

    params: PoolingParams  # resolved: task, normalize and dimensions decided
    pooling_type: str  # "LAST" | "MEAN" | "CLS" | "ALL"
    num_prompt_tokens: int
    acc: Optional[torch.Tensor] = None  # MEAN: [hidden] float32 sum; CLS: [hidden]
    chunks: list[torch.Tensor] = field(default_factory=list)  # ALL: [n_i, hidden] float32


class Pooler:
    """Pools hidden states per request, chunk by chunk (see the module docstring)."""

    def __init__(self, config: PoolerConfig) -> None:
        if config.pooling_type is None:
            raise ValueError("Pooler needs a resolved PoolerConfig (pooling_type is None)")
        self.config = config

    def new_state(self, params: PoolingParams, num_prompt_tokens: int) -> PoolingState:
        pooling_type = "ALL" if params.task == "token_embed" else self.config.pooling_type
        assert pooling_type is not None  # checked in __init__
        return PoolingState(params, pooling_type, num_prompt_tokens)

    def update(self, state: PoolingState, hidden: torch.Tensor,  # [n, hidden]
               start: int) -> Optional[torch.Tensor]:
        """Folds the hidden states of prompt positions [start, start + n) into the state;
        returns the pooled output ([hidden] or [num_prompt_tokens, hidden] for ALL, float32)
        once the chunk reaches the end of the prompt, else None."""
        n = hidden.shape[0]
        end = start + n
        kind = state.pooling_type
        if kind == "MEAN":
            chunk_sum = hidden.float().sum(dim=0)
            state.acc = chunk_sum if state.acc is None else state.acc + chunk_sum
        elif kind == "CLS":
            if start == 0:
                state.acc = hidden[0].float().clone()
        elif kind == "ALL":
            state.chunks.append(hidden.float().clone())
        if end < state.num_prompt_tokens:
            return None
        if kind == "LAST":
            pooled = hidden[-1].float().clone()
        elif kind == "MEAN":
            assert state.acc is not None
            pooled = state.acc / state.num_prompt_tokens
        elif kind == "CLS":
            assert state.acc is not None, "CLS pooling never saw position 0"
            pooled = state.acc
        else:
            pooled = torch.cat(state.chunks) if len(state.chunks) > 1 else state.chunks[0]
        return self.finish(pooled, state.params)

    @staticmethod
    def finish(pooled: torch.Tensor,  # [..., hidden] float32
               params: PoolingParams) -> torch.Tensor:
        """Matryoshka truncation to `dimensions`, then L2 normalization (vLLM's order)."""
        if params.dimensions is not None:
            pooled = pooled[..., : params.dimensions]
        if params.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled
