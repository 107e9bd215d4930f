"""Request state owned by the scheduler, the stop check, and the waiting queues (FCFS, priority).

A request's tokens are `prompt_token_ids + output_token_ids` (`all_token_ids`). The scheduler
catches `num_computed_tokens` (tokens whose KV is in the cache) up with `num_tokens`; there is no
prefill or decode phase. A preempted request keeps its output tokens and recomputes them with
its prompt when it runs again.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyorch.pooling_params import PoolingParams
    from pyorch.sampling_params import SamplingParams
    from pyorch.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence to generate: prompt, outputs so far, and the scheduler's bookkeeping."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # A pooling request (resolved PoolingParams) is prefill only: it finishes when its
        # prompt has run, with the pooled hidden states and no token (its sampling_params are
        # the defaults, never read by the sampler).
        self.pooling_params = pooling_params
        self.max_tokens: int | None = (0 if pooling_params is not None
                                       else sampling_params.max_tokens)
        # (async scheduling) its previous token must land before it is scheduled again
        self.needs_token_history = needs_token_history(sampling_params)
        # What check_stop reads on every token, fixed when the request is made.
        self.min_tokens = sampling_params.min_tokens
        self.stop_eos_token_id = None if sampling_params.ignore_eos else eos_token_id
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        # Its grammar and matcher (structured_outputs), set by the StructuredOutputManager.
        self.structured_output_request: StructuredOutputRequest | None = None

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): scheduled past, not yet
        # appended. The scheduler plans with num_tokens + num_output_placeholders.
        self.num_output_placeholders = 0
        # Prefix-cache hit (tokens) when first scheduled; -1 until then (vLLM's convention).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Prompt positions whose prompt logprobs were already returned (a preempted request
        # recomputes its prompt; its logprobs must not be returned twice).
        self.num_prompt_logprobs_done = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids (the live list: read, never mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def at_length_cap(self, max_model_len: int) -> bool:
        """True when the tokens in flight already reach max_tokens or max_model_len: the request
        will finish when they land, so scheduling it again would compute a token to discard."""
        num_placeholders = self.num_output_placeholders
        if num_placeholders == 0:
            return False
        if self.max_tokens is not None and (
                len(self.output_token_ids) + num_placeholders >= self.max_tokens):
            return True
        return len(self._all_token_ids) + num_placeholders >= max_model_len

    @property
    def use_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, and MEAN/CLS/ALL pooling
        the hidden states of every prompt position, so no prefix hit then."""
        return self.sampling_params.prompt_logprobs is None and self.pooling_params is None

    @property
    def prefix_cache_key(self) -> str:
        """Extra key chained into every block hash: requests with different salts never share."""
        return "" if self.cache_salt is None else "salt:" + self.cache_salt

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED  # RequestStatus.is_finished, inlined

    def get_finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def needs_token_history(params: SamplingParams) -> bool:
    """Sampling that reads the request's output tokens on the host (or returns prompt logprobs,
    whose bookkeeping follows the scheduled chunks), so its previous token must have landed.
    Structured output too: the next step's token bitmask depends on the last token."""
    return bool(
        params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0 or params.min_tokens > 0
        or params.bad_words or params.prompt_logprobs is not None
        or params.structured_outputs is not None
    )


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets the request's finished status and returns True if its last token ends it.

    EOS (unless ignore_eos) and stop_token_ids count only once min_tokens tokens are out; the
    length caps (max_tokens, max_model_len) always apply. Stop strings are the detokenizer's job.
    """
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= request.min_tokens:
        last_token_id = output_token_ids[-1]
        if last_token_id == request.stop_eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if len(request._all_token_ids) >= max_model_len or (
        request.max_tokens is not None and num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


class FCFSRequestQueue:
    """Waiting requests in arrival order; preempted ones go back to the front.
    `num_prompt_tokens` is the sum of their prompt lengths (the scheduler's prefill backlog)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_prompt_tokens = 0

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        request = self._queue.popleft()
        self.num_prompt_tokens -= request.num_prompt_tokens
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self.num_prompt_tokens -= request.num_prompt_tokens

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Waiting requests by (priority, arrival_time): lower priority value first, then earlier.
    `num_prompt_tokens` is the sum of their prompt lengths (the scheduler's prefill backlog)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # ties keep insertion order; Requests never compare
        self.num_prompt_tokens = 0

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)
        self.num_prompt_tokens += request.num_prompt_tokens

    # A preempted request keeps its (priority, arrival_time), which already puts it ahead of
    # every later arrival of the same priority.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        request = heapq.heappop(self._heap)[3]
        self.num_prompt_tokens -= request.num_prompt_tokens
        return request

    def remove(self, request: Request) -> None:
        size = len(self._heap)
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)
        if len(self._heap) < size:
            self.num_prompt_tokens -= request.num_prompt_tokens

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (expected 'fcfs' or 'priority')")
