"""OutputProcessor: turns the engine core's per-step token outputs into RequestOutputs.

It owns, per request, the detokenizer (text and stop strings) and the logprobs processor, and
fans a request with n > 1 out into n child requests (ids "i_parent") whose outputs it gathers
back into one RequestOutput, shaped by `SamplingParams.output_kind` (cumulative, delta, or final
only). It also measures what the metrics need (time to first token, inter-token latencies,
finished requests) into an `IterationStats` when given one.

Pooling requests (prefill only) have no children, detokenizer or logprobs: the core's one output
for such a request carries its pooled array, which becomes a finished `PoolingRequestOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch

from pyorch.engine.detokenizer import IncrementalDetokenizer
from pyorch.engine.logprobs import LogprobsProcessor
from pyorch.metrics.stats import FinishedRequestStats, IterationStats
from pyorch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pyorch.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pyorch.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Child:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_generated: int = 0  # tokens the core generated (stop tokens included)
    last_token_time: Optional[float] = None
    num_token_ids_sent: int = 0  # DELTA bookkeeping: what earlier outputs already held
    num_logprobs_sent: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: dict[str, _Child]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0
    num_finished: int = 0
    child_order: list[str] = field(default_factory=list)
    n: int = 1  # the request's n and max_tokens, for the request_params_* metrics
    max_tokens: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


@dataclass
class _PoolingRequest:
    prompt_token_ids: list[int]
    metrics: RequestMetrics


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}
        self.pooling: dict[str, _PoolingRequest] = {}  # pooling requests (one id each)

    def num_unfinished(self) -> int:
        return len(self.parents) + len(self.pooling)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.pooling

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            arrival_time: Optional[float] = None) -> None:
        """Registers a pooling request (its id is also its id in the core)."""
        if self.has_request(request_id) or request_id in self.child_to_parent:
            raise ValueError(f"request id {request_id!r} is already running")
        metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.pooling[request_id] = _PoolingRequest(list(prompt_token_ids), metrics)

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, eos_token_id: Optional[int],
                    vocab_size: Optional[int] = None,
                    arrival_time: Optional[float] = None) -> list[tuple[str, SamplingParams]]:
        """Registers a request; returns its (child id, child params) pairs for the scheduler."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already running")
        if vocab_size is not None:
            params.validate_token_ids(vocab_size)
        children: dict[str, _Child] = {}
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index  # distinct but reproducible samples
            child_params.update_from_generation_config({}, eos_token_id)
            if self.tokenizer is not None:
                child_params.update_from_tokenizer(self.tokenizer)
            child_id = child_request_id(request_id, index, params.n)
            if child_id in self.child_to_parent:
                raise ValueError(f"request id {child_id!r} is already running")
            tok = self.tokenizer
            children[child_id] = _Child(
                index=index, params=child_params,
                detokenizer=IncrementalDetokenizer(tok, prompt_token_ids, child_params),
                logprobs=LogprobsProcessor.from_params(tok, child_params),
            )
        metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        parent = _Parent(request_id, prompt, list(prompt_token_ids), children, metrics,
                         output_kind=params.output_kind, child_order=list(children),
                         n=params.n, max_tokens=params.max_tokens)
        self.parents[request_id] = parent
        for child_id in children:
            self.child_to_parent[child_id] = request_id
        return [(cid, c.params) for cid, c in children.items()]

    def abort_requests(self, request_ids: Iterable[str],
                       iteration_stats: Optional[IterationStats] = None) -> list[str]:
        """Forgets the given parent requests; returns their child ids to abort in the core."""
        child_ids: list[str] = []
        for request_id in request_ids:
            if self.pooling.pop(request_id, None) is not None:
                child_ids.append(request_id)
                continue
            parent = self._pop(request_id)
            if parent is None:
                continue
            child_ids.extend(parent.children)
            if iteration_stats is not None:
                self._record_finished(parent, "abort", time.time(), iteration_stats)
        return child_ids

    def finish_aborted(self, request_ids: Iterable[str],
                       iteration_stats: Optional[IterationStats] = None,
                       ) -> tuple[list[str], list[RequestOutput]]:
        """Like `abort_requests`, but also returns each request's last RequestOutput, finished,
        with finish_reason "abort" on every sequence still running (for streaming front ends)."""
        child_ids: list[str] = []
        outputs: list[RequestOutput] = []
        now = time.time()
        for request_id in request_ids:
            if self.pooling.pop(request_id, None) is not None:
                child_ids.append(request_id)  # nothing was streamed: no last output to send
                continue
            parent = self._pop(request_id)
            if parent is None:
                continue
            child_ids.extend(parent.children)
            touched = set()
            for child_id, child in parent.children.items():
                if child.finish_reason is None:
                    child.finish_reason = "abort"
                    parent.num_finished += 1
                    touched.add(child_id)
            parent.metrics.finished_time = now
            outputs.append(self._make_output(parent, touched))
            if iteration_stats is not None:
                self._record_finished(parent, "abort", now, iteration_stats)
        return child_ids, outputs

    def _pop(self, request_id: str) -> Optional[_Parent]:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.children:
                self.child_to_parent.pop(child_id, None)
        return parent

    def mark_scheduled(self, child_ids: Iterable[str], scheduled_time: float) -> None:
        """Records when requests first entered a batch (for queue-time metrics)."""
        for child_id in child_ids:
            parent = self.parents.get(self.child_to_parent.get(child_id, ""))
            pooling = self.pooling.get(child_id) if parent is None else None
            metrics = parent.metrics if parent is not None else (
                pooling.metrics if pooling is not None else None)
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = scheduled_time
                metrics.time_in_queue = scheduled_time - metrics.arrival_time

    def process_outputs(self, core_outputs: Iterable[Any],
                        iteration_stats: Optional[IterationStats] = None,
                        ) -> tuple[list[Union[RequestOutput, PoolingRequestOutput]], list[str]]:
        """Applies one step's EngineCoreOutputs. Returns the RequestOutputs of every request that
        changed (per its output_kind) and the PoolingRequestOutputs of pooling requests that
        finished, and the child ids whose stop string was found (to finish in the core)."""
        now = time.time()
        touched: dict[str, tuple[_Parent, set[str]]] = {}
        stopped: list[str] = []
        outputs: list[Union[RequestOutput, PoolingRequestOutput]] = []
        get_parent_id, parents, pooling = self.child_to_parent.get, self.parents, self.pooling
        for out in core_outputs:
            parent_id = get_parent_id(out.req_id)
            if parent_id is None:
                if pooling and out.req_id in pooling:
                    pooled_output = self._pooling_output(out, now, iteration_stats)
                    if pooled_output is not None:
                        outputs.append(pooled_output)
                continue  # else aborted meanwhile
            parent = parents[parent_id]
            child = parent.children[out.req_id]
            if child.finish_reason is not None:
                continue
            if out.new_token_ids:
                self._record_tokens(parent, child, len(out.new_token_ids), now, iteration_stats)
            if out.num_cached_tokens is not None:
                parent.num_cached_tokens = out.num_cached_tokens
            if out.new_logprobs is not None or out.new_prompt_logprobs is not None:
                child.logprobs.update_from_output(out.new_logprobs, out.new_prompt_logprobs)
            # The scheduler finishes with "stop" only on EOS or a stop token id.
            stop_terminated = out.finish_reason == "stop"
            stop_str = child.detokenizer.update(out.new_token_ids, stop_terminated)
            if (stop_str is None and out.finish_reason is None and len(parent.children) == 1
                    and parent.output_kind == RequestOutputKind.FINAL_ONLY):
                continue  # still running, and nothing to send until it finishes
            if stop_str is not None and out.finish_reason in (None, "length"):
                # A stop string completed by the last allowed token is still a stop (as vLLM).
                child.finish_reason, child.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    stopped.append(out.req_id)
            elif out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            elif stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                stopped.append(out.req_id)
            if child.finish_reason is not None:
                parent.num_finished += 1
            touched.setdefault(parent_id, (parent, set()))[1].add(out.req_id)
        for parent_id, (parent, child_ids) in touched.items():
            if parent.finished:
                parent.metrics.finished_time = now
                self._pop(parent_id)
                if iteration_stats is not None:
                    reason = parent.children[parent.child_order[0]].finish_reason or "stop"
                    self._record_finished(parent, reason, now, iteration_stats)
            if parent.finished or parent.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(parent, child_ids))
        return outputs, stopped

    def _pooling_output(self, out: Any, now: float, stats: Optional[IterationStats],
                        ) -> Optional[PoolingRequestOutput]:
        """The finished output of a pooling request (None if it finished without a result:
        aborted in the core)."""
        if out.finish_reason is None:
            return None
        request = self.pooling.pop(out.req_id)
        m = request.metrics
        m.finished_time = m.first_token_time = m.last_token_time = now
        num_prompt = len(request.prompt_token_ids)
        if stats is not None:
            stats.num_prompt_tokens += num_prompt
            scheduled = m.first_scheduled_time
            stats.finished_requests.append(FinishedRequestStats(
                finish_reason=out.finish_reason if out.pooled is not None else "abort",
                e2e_latency=now - m.arrival_time, num_prompt_tokens=num_prompt,
                num_generation_tokens=0,
                queued_time=(scheduled - m.arrival_time) if scheduled is not None else 0.0,
                prefill_time=(now - scheduled) if scheduled is not None else 0.0))
        if out.pooled is None:
            return None
        # A copy: the wire's array is a read-only view of the received frame.
        data = torch.from_numpy(out.pooled.copy())
        return PoolingRequestOutput(out.req_id, PoolingOutput(data), request.prompt_token_ids,
                                    out.num_cached_tokens or 0, True)

    # ---- metrics -----------------------------------------------------------------------------
    @staticmethod
    def _record_tokens(parent: _Parent, child: _Child, num_new: int, now: float,
                       stats: Optional[IterationStats]) -> None:
        metrics = parent.metrics
        if stats is not None:
            stats.num_generation_tokens += num_new
            if metrics.first_token_time is None:
                stats.time_to_first_tokens.append(now - metrics.arrival_time)
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
            elif child.last_token_time is not None:
                stats.inter_token_latencies.append(now - child.last_token_time)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        child.last_token_time = now
        child.num_generated += num_new

    @staticmethod
    def _record_finished(parent: _Parent, reason: str, now: float,
                         stats: IterationStats) -> None:
        m = parent.metrics
        first_token, scheduled = m.first_token_time, m.first_scheduled_time
        stats.finished_requests.append(FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - m.arrival_time,
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_generation_tokens=sum(c.num_generated for c in parent.children.values()),
            queued_time=(scheduled - m.arrival_time) if scheduled is not None else 0.0,
            prefill_time=(first_token - scheduled)
            if first_token is not None and scheduled is not None else 0.0,
            decode_time=(m.last_token_time - first_token)
            if first_token is not None and m.last_token_time is not None else 0.0,
            inference_time=(m.last_token_time - scheduled)
            if scheduled is not None and m.last_token_time is not None else 0.0,
            n_param=parent.n, max_tokens_param=parent.max_tokens,
        ))

    # ---- outputs -----------------------------------------------------------------------------
    def _make_output(self, parent: _Parent, touched: set[str]) -> RequestOutput:
        delta = parent.output_kind == RequestOutputKind.DELTA
        completions = []
        for child_id in parent.child_order:
            if delta and child_id not in touched:
                continue  # unchanged this step: nothing to send
            child = parent.children[child_id]
            completions.append(self._completion(child, delta))
        first = parent.children[parent.child_order[0]].logprobs
        prompt_logprobs = first.pop_prompt_logprobs() if delta else first.prompt_logprobs
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions,
            finished=parent.finished, metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
        )

    @staticmethod
    def _completion(child: _Child, delta: bool) -> CompletionOutput:
        det, lp = child.detokenizer, child.logprobs
        finished = child.finish_reason is not None
        # Slices are copies: outputs may be consumed later, after the processor's lists have
        # grown. A delta copies only its new tokens (this runs per request per step).
        all_ids = det.token_ids
        if delta:
            token_ids = all_ids[det.num_prompt_tokens + child.num_token_ids_sent:]
            child.num_token_ids_sent += len(token_ids)
            logprobs = None
            if lp.logprobs is not None:
                logprobs = lp.logprobs[child.num_logprobs_sent:]
                child.num_logprobs_sent += len(logprobs)
        else:
            token_ids = all_ids[det.num_prompt_tokens:]
            logprobs = None if lp.logprobs is None else list(lp.logprobs)
        return CompletionOutput(
            index=child.index,
            text=det.get_next_output_text(finished, delta=delta),
            token_ids=token_ids,
            cumulative_logprob=lp.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )
