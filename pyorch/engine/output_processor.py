"""OutputProcessor: turns the scheduler's per-step token outputs into RequestOutputs.

It owns, per request, the detokenizer (text and stop strings) and the logprobs processor, and
fans a request with n > 1 out into n child requests (ids "i_parent") whose outputs it gathers
back into one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from pyorch.engine.detokenizer import IncrementalDetokenizer
from pyorch.engine.logprobs import LogprobsProcessor
from pyorch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pyorch.sampling_params import SamplingParams


@dataclass
class _Child:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: dict[str, _Child]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    num_finished: int = 0
    prompt_logprobs: Any = None
    child_order: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def num_unfinished(self) -> int:
        return len(self.parents)

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, eos_token_id: Optional[int],
                    vocab_size: Optional[int] = None) -> list[tuple[str, SamplingParams]]:
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
            tok = self.tokenizer
            children[child_id] = _Child(
                index=index, params=child_params,
                detokenizer=IncrementalDetokenizer(tok, prompt_token_ids, child_params),
                logprobs=LogprobsProcessor.from_params(tok, child_params),
            )
        parent = _Parent(request_id, prompt, list(prompt_token_ids), children,
                         RequestMetrics(arrival_time=time.time()), child_order=list(children))
        self.parents[request_id] = parent
        for child_id in children:
            self.child_to_parent[child_id] = request_id
        return [(cid, c.params) for cid, c in children.items()]

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets the given parent requests; returns their child ids to abort in the scheduler."""
        child_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            for child_id in parent.children:
                self.child_to_parent.pop(child_id, None)
                child_ids.append(child_id)
        return child_ids

    def process_outputs(self, core_outputs: Iterable[Any]) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's EngineCoreOutputs. Returns the RequestOutputs of every request that
        changed, and the child ids whose stop string was found (to finish in the scheduler)."""
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for out in core_outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue  # aborted meanwhile
            parent = self.parents[parent_id]
            child = parent.children[out.req_id]
            if child.finish_reason is not None:
                continue
            if parent.metrics.first_token_time is None and out.new_token_ids:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            if out.num_cached_tokens is not None:
                parent.num_cached_tokens = out.num_cached_tokens
            child.logprobs.update_from_output(out.new_logprobs, out.new_prompt_logprobs)
            # The scheduler finishes with "stop" only on EOS or a stop token id.
            stop_terminated = out.finish_reason == "stop"
            stop_str = child.detokenizer.update(list(out.new_token_ids), stop_terminated)
            if out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            elif stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                stopped.append(out.req_id)
            if child.finish_reason is not None:
                parent.num_finished += 1
            touched[parent_id] = parent
        outputs = []
        for parent_id, parent in touched.items():
            outputs.append(self._make_output(parent))
            if parent.finished:
                parent.metrics.finished_time = now
                del self.parents[parent_id]
                for child_id in parent.children:
                    self.child_to_parent.pop(child_id, None)
        return outputs, stopped

    def _make_output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for child_id in parent.child_order:
            child = parent.children[child_id]
            det = child.detokenizer
            finished = child.finish_reason is not None
            completions.append(CompletionOutput(
                index=child.index,
                text=det.get_next_output_text(finished, delta=False),
                token_ids=list(det.output_token_ids),
                cumulative_logprob=child.logprobs.cumulative_logprob,
                logprobs=child.logprobs.logprobs,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[parent.child_order[0]]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.logprobs.prompt_logprobs, outputs=completions,
            finished=parent.finished, metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
        )
