"""What the scheduler hands the model runner each step: a diff.

Who owns what:
- The scheduler owns the `Request`s (token ids, status, num_computed_tokens) and, through the
  KVCacheManager, every block. Each step it sends a `SchedulerOutput`: full data only for
  requests the runner does not hold (new, or resumed after a preemption), and for the others only
  the blocks appended and the tokens to run.
- The model runner keeps its own copy of each running request's token ids and block ids, updates
  it from the diff, and appends the tokens it samples. It drops every id in `finished_req_ids`
  first (finished, aborted, or preempted: a preempted request comes back as a new request).
- `update_from_output` turns the runner's `ModelRunnerOutput` into one `EngineCoreOutput`
  (`pyorch.core_types`) per request that got tokens (or prompt logprobs, or finished).
- Its stats for metrics are a `SchedulerStats` (`pyorch.metrics.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pyorch.pooling_params import PoolingParams
    from pyorch.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold yet: first schedule, or resumption after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption ([] for a fresh request)
    sampling_params: SamplingParams
    block_ids: list[int]  # all of the request's blocks, in order
    num_computed_tokens: int  # tokens whose KV is already in those blocks (prefix hits)
    # Resolved pooling parameters of a pooling request (prefill only, pooled, never sampled).
    pooling_params: Optional[PoolingParams] = None


@dataclass(frozen=True)
class CachedRequestData:
    """Requests the runner already holds, scheduled again this step (parallel lists)."""

    req_ids: list[str]
    new_block_ids: list[list[int]]  # blocks appended since the last step (may be [])
    num_computed_tokens: list[int]  # tokens computed before this step (where this step starts)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], [], [])


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, as a diff against the runner's state."""

    scheduled_new_reqs: list[NewRequestData]  # requests the runner must add
    scheduled_cached_reqs: CachedRequestData  # requests the runner holds
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to run this step
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    finished_req_ids: set[str]  # finished/aborted/PREEMPTED since last step: runner drops them
    # Requests with structured_outputs that sample a token this step, in scheduling order: the
    # rows of the step's grammar bitmask (StructuredOutputManager.grammar_bitmask).
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Of total_num_scheduled_tokens, the one-token decodes of running requests (the step-time
    # model prices them apart from prompt tokens).
    num_decode_tokens: int = 0
