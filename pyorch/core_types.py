"""The data the engine core hands to the front end, in a torch-free module both sides import.

- `LogprobsLists`: host copies of the sampler's logprobs (made by the model runner, carried by
  the core, cut per request by `pyorch.engine.logprobs`).
- `EngineCoreOutput`: per request and step, the tokens appended and why the request finished
  (or, for a pooling request, its pooled hidden states as a numpy array).

Neither side owns these types, so neither side's modules (`pyorch.core`, `pyorch.layers`,
`pyorch.engine`) have to import the other's to use them. `SchedulerStats` lives with the other
stats in `pyorch.metrics.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import numpy as np


class LogprobsLists(NamedTuple):
    """Host copy of the sampler's `LogprobsTensors`; row r describes one position (column 0 = the
    chosen token, columns 1..N the top-N in descending order)."""

    logprob_token_ids: list[list[int]]  # [num_rows][num_logprobs + 1]
    logprobs: list[list[float]]  # [num_rows][num_logprobs + 1]
    sampled_token_ranks: list[int]  # [num_rows], rank of column 0's token (1 = most likely)

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )


@dataclass
class EngineCoreOutput:
    """Per request and step: the tokens appended (stop checks applied) and why it finished."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None (still running)
    stop_reason: Union[int, str, None] = None  # the stop token id that ended it, if any
    # One row per token in new_token_ids, when the request asked for logprobs.
    new_logprobs: Optional[LogprobsLists] = None
    # One row per prompt position computed this step, when it asked for prompt logprobs.
    new_prompt_logprobs: Optional[LogprobsLists] = None
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) when the request was first scheduled
    # A pooling request's result (it finishes in the same output): float32, [hidden] for one
    # vector per prompt, [num_prompt_tokens, hidden] for one per token.
    pooled: Optional[np.ndarray] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
