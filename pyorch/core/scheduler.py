"""The scheduler: a phase-free, continuous-batching loop over a token budget (vLLM v1's design).

Each request has `num_computed_tokens` catching up with `num_tokens`. A step hands out
`num_scheduled_tokens[req_id]` under `max_num_batched_tokens` and `max_num_seqs`, in three passes:
running decodes first (each gets its token wherever the step has room), then the prompt chunks of
running requests in (priority,) arrival order, then waiting requests (new, or resumed after a
preemption) in queue order, with prefix-cache hits skipping computed blocks. Prompt chunks share
the step budget left after the decodes: max_num_batched_tokens, or with `target_step_ms` the tokens
a step of that length carries according to the measured step times (`pyorch.core.step_budget`),
and never fewer than `_MIN_PREFILL_TOKENS`. `long_prefill_token_threshold` caps one request's chunk,
so a long prompt cannot hold the prefill budget while shorter ones wait. When blocks run out, the
lowest-priority (then latest-arriving) running request is preempted: its blocks are freed and it
is recomputed later, keeping the tokens it generated.

Preemption recomputes work, so admission looks ahead (`reserve_kv_for_growth`): a waiting request
starts only if the free blocks left after it still cover the expected growth of every running
request, `growth_ratio` x (the blocks each still needs to reach its length cap: prompt + max_tokens,
at most max_model_len). `growth_ratio` is learned: the running mean of how much of its cap a
finished request used (1.0 when every request runs to max_tokens, as with ignore_eos; small when
requests stop early on EOS), raised after each preemption. It starts at 1.0, so nothing is
admitted that the cache could not hold to the end until finished requests say otherwise. One
exception (`_tail_may_overcommit`): a thin tail of the waiting queue (at most 1/8 of the running
batch, its length caps at most 1/8 of the cache, never preempted before) starts anyway, rather
than run alone at a small batch after the batch ahead of it finishes; if the cache runs out, it is
what gets preempted and recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pyorch.core.kv_cache_manager import KVCacheManager
from pyorch.core.request import Request, RequestStatus, check_stop, create_request_queue
from pyorch.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pyorch.core.step_budget import StepCostModel
from pyorch.core_types import EngineCoreOutput, LogprobsLists
from pyorch.metrics.stats import SchedulerStats
from pyorch.structured_output.manager import StructuredOutputRequest, accept_sampled
from pyorch.utils import cdiv

if TYPE_CHECKING:
    from pyorch.config import CacheConfig, SchedulerConfig
    from pyorch.executor.step import ModelRunnerOutput

logger = logging.getLogger(__name__)

# growth_ratio: weight of each finished request in its running mean, and the step it takes up
# after a preemption.
_GROWTH_EMA = 1 / 32
_PREEMPTION_BUMP = 0.1
# A waiting queue this many times shorter than the running batch, whose length caps take at most
# this share of the KV cache, may start past the growth reservation (_tail_may_overcommit).
_TAIL_OVERCOMMIT = 8
# Prefill tokens a step carries at least, whatever the step budget (capped by
# max_num_batched_tokens): a decode batch slower than target_step_ms alone never stalls prompts.
_MIN_PREFILL_TOKENS = 256
# The step-cost fit is logged every this many measured steps.
_LOG_FIT_EVERY = 1000


@dataclass
class _StepState:
    """What one schedule() call has handed out so far."""

    budget: int  # tokens the current pass may still hand out
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: bool = False
    num_prefills: int = 0  # requests given prompt tokens this step
    num_long_prefills: int = 0  # of them, longer than long_prefill_token_threshold


class Scheduler:
    """Decides each step's batch and applies the runner's results.

    Parameters
    ----------
    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one step.
    max_model_len: longest sequence (prompt + output); longer prompts are rejected.
    block_size, num_blocks: the KV pool (num_blocks includes the null block).
    enable_prefix_caching: reuse cached full blocks across requests.
    enable_chunked_prefill: split prompts over steps; when off, a prompt runs whole in one step.
    policy: "fcfs" (arrival order) or "priority" (lower value first, then arrival).
    long_prefill_token_threshold: when > 0, most tokens one request gets per step (and the
        length past which a prompt counts as long for max_long_partial_prefills).
    max_num_partial_prefills, max_long_partial_prefills: with max_num_partial_prefills > 1, at
        most that many prompts are prefilled in one step, at most max_long_partial_prefills of
        them long; a long waiting prompt is passed over while the long slots are taken.
    target_step_ms: when set, the step budget comes from the measured step times
        (`pyorch.core.step_budget`); the engine reports each step with `record_step_time`.
    min_prefill_tokens: prefill tokens a step may carry whatever the budget (tests shrink it).
    hash_bits: prefix-cache bucket bits (tests only).
    reserve_kv_for_growth: admit a waiting request only when the KV cache keeps room for the
        expected growth of the running ones (module docstring); False admits whatever fits now,
        as vLLM does, and relies on preemption.
    tail_overcommit: let a thin tail of the waiting queue start past that reservation
        (`_tail_may_overcommit`); off only to compare policies (bench/scheduler_replay.py).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int,
        block_size: int = 16,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        hash_bits: int = 64,
        reserve_kv_for_growth: bool = True,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int = 1,
        target_step_ms: Optional[float] = None,
        min_prefill_tokens: int = _MIN_PREFILL_TOKENS,
        tail_overcommit: bool = True,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: this effectively limits the "
                "maximum sequence length. Raise max_num_batched_tokens or enable chunked prefill."
            )
        capacity = (num_blocks - 1) * block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks - 1} blocks of {block_size}), "
                f"fewer than max_model_len ({max_model_len}): one request of the maximum length "
                "could never run. Give the KV cache more memory or lower max_model_len."
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_long_partial_prefills = max_long_partial_prefills
        # Prefill tokens every step may carry whatever the decodes cost: prompts always progress.
        self.min_prefill_tokens = max(1, min(min_prefill_tokens, max_num_batched_tokens))
        self.step_cost = (StepCostModel(target_step_ms, max_num_batched_tokens,
                                        self.min_prefill_tokens)
                          if target_step_ms else None)
        # A prefill backlog of more than one full step is being worked off (_update_burst):
        # prompt chunks fill max_num_batched_tokens instead of the step budget.
        self.burst = False
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, hash_bits
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.reserve_kv_for_growth = reserve_kv_for_growth
        self.tail_overcommit = tail_overcommit
        self.growth_ratio = 1.0  # expected share of its length cap a request still grows into
        self._failed_outputs: list[EngineCoreOutput] = []  # dropped before they ran (_fail_request)

    @classmethod
    def from_config(cls, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                    num_blocks: int) -> Scheduler:
        """Builds a scheduler from config objects with vLLM's field names."""
        sc, cc = scheduler_config, cache_config
        return cls(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len,
            block_size=cc.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=cc.enable_prefix_caching,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            policy=sc.policy,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
            reserve_kv_for_growth=sc.reserve_kv_for_growth,
            max_num_partial_prefills=sc.max_num_partial_prefills,
            max_long_partial_prefills=sc.max_long_partial_prefills,
            target_step_ms=sc.target_step_ms,
        )

    # ---- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises ValueError (nothing queued) if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # The front ends check prompts (pyorch.engine.input_processor.check_prompt); with the
        # capacity check in __init__, such a prompt always fits the KV cache.
        assert 0 < request.num_prompt_tokens <= self.max_model_len, request.num_prompt_tokens
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finishes (e.g. aborts) requests wherever they are; ignores unknown or finished ids."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        done = [self.requests[i] for i in ids if i in self.requests]
        for request in done:
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
        if done:
            self.running = [r for r in self.running if not r.is_finished()]

    def _free_request(self, request: Request) -> None:
        if request.status != RequestStatus.FINISHED_ABORTED:
            cap = self._length_cap(request) - request.num_prompt_tokens
            used = len(request.output_token_ids) / cap if cap > 0 else 1.0
            self.growth_ratio += _GROWTH_EMA * (min(used, 1.0) - self.growth_ratio)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's batch, in three passes (see `docs/architecture.md`, "The scheduling
        policy"): running decodes first, under max_num_batched_tokens only; then prefill chunks
        of running requests, oldest first (priority policy: highest priority first); then
        waiting requests in queue order. Prefill chunks share what is left of the step budget
        (`step_token_budget`), at least `min_prefill_tokens` of it."""
        st = _StepState(self.max_num_batched_tokens)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            num_wanted = (request.num_tokens + request.num_output_placeholders
                          - request.num_computed_tokens)
            if num_wanted <= 0 or (request.num_output_placeholders
                                   and request.at_length_cap(self.max_model_len)):
                continue  # (async) waits for its in-flight token, which may finish it
            (decodes if num_wanted == 1 else prefills).append(request)

        # Every decode that fits gets its token, whatever the budget. The common case (room
        # left in its last block) is inlined: it runs for every running request on every step.
        kv_blocks, block_size = self.kv_cache_manager.req_to_blocks, self.block_size
        running_status = RequestStatus.RUNNING
        scheduled_running, num_scheduled = st.scheduled_running, st.num_scheduled
        new_block_ids = st.new_block_ids
        for request in decodes:
            if st.budget <= 0:
                break
            if request.status != running_status:
                continue  # preempted earlier in this pass
            blocks = kv_blocks.get(request.request_id)
            if blocks and request.num_computed_tokens < len(blocks) * block_size:
                scheduled_running.append(request)
                num_scheduled[request.request_id] = 1
                new_block_ids[request.request_id] = []
                st.budget -= 1
            else:
                self._schedule_running(request, 1, st)
        num_decode_tokens = self.max_num_batched_tokens - st.budget
        if self.enable_chunked_prefill:
            # What prefill chunks may add: the step budget past the decodes, at least
            # min_prefill_tokens so that prompts progress under any decode load. (A prompt
            # that runs whole needs max_num_batched_tokens, so without chunking this is off.)
            self._update_burst(bool(prefills))
            st.budget = min(st.budget, max(self.prefill_token_budget(num_decode_tokens),
                                           self.min_prefill_tokens))

        prefills.sort(key=self._queue_key)
        for request in prefills:
            if request.status != RequestStatus.RUNNING or st.budget <= 0:
                continue
            num_wanted = request.num_tokens - request.num_computed_tokens
            if not self._prefill_slot_free(num_wanted, st):
                continue
            num_new = self._num_new_tokens(num_wanted, st.budget)
            if self._schedule_running(request, num_new, st):
                self._take_prefill_slot(num_wanted, st)
        # Full prompt blocks this step fills may serve the requests admitted after them in this
        # same step (no preemption can undo a scheduled request past this point): each layer
        # writes the KV of every token of the step before its attention reads any (vLLM caches
        # at allocation for the same reason). Without this, requests sharing a prefix that
        # arrive together each recompute it.
        if self.kv_cache_manager.enable_caching:
            for request in prefills:
                num_chunk = st.num_scheduled.get(request.request_id, 0)
                if num_chunk:
                    self.kv_cache_manager.cache_blocks(
                        request, min(request.num_computed_tokens + num_chunk, request.num_tokens))

        if not st.preempted:  # a step that had to preempt has no room to grow
            self._schedule_waiting(st)
        if st.preempted:  # a preemption may have taken back a decode scheduled above
            num_decode_tokens = sum(st.num_scheduled.get(r.request_id) == 1 for r in decodes)
        return self._make_output(st.scheduled_new, st.scheduled_running, st.num_scheduled,
                                 st.new_block_ids, num_decode_tokens)

    def _schedule_running(self, request: Request, num_new: int, st: _StepState) -> bool:
        """Allocates for a running request, preempting from the low-priority end when blocks
        run out. False when the request had to preempt itself."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if blocks is not None:
                break
            victim = self._pick_victim()
            self.running.remove(victim)
            if victim.request_id in st.num_scheduled:  # scheduled earlier in this step: undo
                st.budget += st.num_scheduled.pop(victim.request_id)
                st.new_block_ids.pop(victim.request_id)
                st.scheduled_running.remove(victim)
            self._preempt(victim)
            st.preempted = True
            if victim is request:
                return False
        st.scheduled_running.append(request)
        st.num_scheduled[request.request_id] = num_new
        st.new_block_ids[request.request_id] = blocks
        st.budget -= num_new
        return True

    def _schedule_waiting(self, st: _StepState) -> None:
        """Admits waiting requests in queue order while the budget, max_num_seqs and the KV
        cache allow. Only concurrent partial prefills (max_num_partial_prefills > 1) pass over
        a request: a long prompt while the long slots are taken."""
        kv = self.kv_cache_manager
        reserved = -1.0  # blocks kept for the running requests' expected growth (lazily summed)
        skipped = 0
        compiling: list[Request] = []  # grammars still compiling: they keep their place
        while (self.waiting and st.budget > 0 and len(self.running) < self.max_num_seqs
               and skipped < len(self.waiting)):
            request = self.waiting.peek() if not skipped else self._nth_waiting(skipped)
            so_request = request.structured_output_request
            if so_request is not None and (not so_request.is_ready or so_request.error):
                self.waiting.remove(request)
                if so_request.error is None:
                    compiling.append(request)  # vLLM's WAITING_FOR_FSM: the others go ahead
                else:
                    self._fail_request(request, so_request.error)
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_wanted = request.num_tokens - num_hit
            if not self._prefill_slot_free(num_wanted, st):
                if st.num_prefills < self.max_num_partial_prefills:
                    skipped += 1  # a long prompt while the long slots are taken: try shorter ones
                    continue
                break
            if not self.enable_chunked_prefill and num_wanted > st.budget:
                break  # a prompt runs whole: wait for a step with room (keeps FCFS order)
            num_new = self._num_new_tokens(num_wanted, st.budget)
            if self.reserve_kv_for_growth and self.running:
                if reserved < 0:
                    reserved = self.growth_ratio * sum(map(self._growth_blocks, self.running))
                held = cdiv(num_hit + num_new, self.block_size)  # this request's blocks after
                growth = self.growth_ratio * max(
                    cdiv(self._length_cap(request), self.block_size) - held, 0)
                if (kv.num_free_blocks - (held - len(hit_blocks)) < reserved + growth
                        and not self._tail_may_overcommit(request)):
                    break  # it would crowd out the running requests' growth: wait
                reserved += growth
            blocks = kv.allocate_slots(request, num_new, num_hit, hit_blocks)
            if blocks is None:
                break
            # Its prompt blocks may serve the requests admitted after it in this step (above).
            kv.cache_blocks(request, min(num_hit + num_new, request.num_tokens))
            if kv.enable_caching and request.use_prefix_cache:
                kv.record_prefix_lookup(request.num_tokens, num_hit)
            if skipped:
                self.waiting.remove(request)
            else:
                self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            st.scheduled_new.append(request)
            st.num_scheduled[request.request_id] = num_new
            st.budget -= num_new
            self._take_prefill_slot(num_wanted, st)
        for request in reversed(compiling):
            self.waiting.prepend(request)

    def _tail_may_overcommit(self, request: Request) -> bool:
        """Whether a waiting request that the growth reservation turns away may start anyway:
        the waiting queue is a thin tail (at most 1/_TAIL_OVERCOMMIT of the running batch, and
        its requests' length caps at most 1/_TAIL_OVERCOMMIT of the KV cache) and this request was
        never preempted. Held back, such a tail waits for the batch ahead of it to finish (requests
        of one length finish together) and then runs alone for its whole length at a small batch,
        where a step costs nearly what a full one does; started now, it is preempted (it arrived
        last) only if the cache does run out, and recomputes at most that small share of the
        cache in prefill steps, which are cheap per token. On an H200, fp8 Llama-3-8B 1000/1000
        x1000 (1,882,304 KV tokens: 941 requests to their cap) ran its last 59 requests alone for
        948 decode steps of 6.1 ms, 5.75 of 62 s; with this rule, 107 such steps and 49
        preemptions, 16,031 -> 16,517 output tok/s (bench/results/NVIDIA_H200/
        fp8_vs_vllm_20261129). A longer queue keeps the reservation: there the
        batch stays full from the queue, and overcommitting only trades compute for recompute
        (the recompute-only policy preempted 579 times on an H100's 1000/1000)."""
        if (not self.tail_overcommit or request.num_preemptions
                or len(self.waiting) * _TAIL_OVERCOMMIT > len(self.running)):
            return False
        budget = self.kv_cache_manager.num_blocks // _TAIL_OVERCOMMIT
        for waiting in self.waiting:
            budget -= cdiv(self._length_cap(waiting), self.block_size)
            if budget < 0:
                return False
        return True

    def _nth_waiting(self, n: int) -> Request:
        for i, request in enumerate(self.waiting):
            if i == n:
                return request
        raise IndexError(n)

    def _queue_key(self, request: Request) -> tuple[int, float]:
        """Who goes first among equals: (priority under the priority policy, arrival time)."""
        return (request.priority if self.policy == "priority" else 0, request.arrival_time)

    def _is_long_prefill(self, num_wanted: int) -> bool:
        return 0 < self.long_prefill_token_threshold < num_wanted

    def _prefill_slot_free(self, num_wanted: int, st: _StepState) -> bool:
        """Concurrent partial prefills (vLLM's max_num_partial_prefills /
        max_long_partial_prefills): at most that many prompts prefilled in one step, of them at
        most max_long_partial_prefills longer than long_prefill_token_threshold. With
        max_num_partial_prefills 1 (the default, as vLLM's V1 engine) the number is not limited."""
        if self.max_num_partial_prefills <= 1:
            return True
        if st.num_prefills >= self.max_num_partial_prefills:
            return False
        return not (self._is_long_prefill(num_wanted)
                    and st.num_long_prefills >= self.max_long_partial_prefills)

    def _take_prefill_slot(self, num_wanted: int, st: _StepState) -> None:
        st.num_prefills += 1
        st.num_long_prefills += self._is_long_prefill(num_wanted)

    # ---- the step budget ---------------------------------------------------------------------
    @property
    def step_token_budget(self) -> int:
        """Tokens a step without decodes may carry: from the step-time model when
        `target_step_ms` is set, else max_num_batched_tokens."""
        return self.prefill_token_budget(0)

    def prefill_token_budget(self, num_decode_tokens: int) -> int:
        """Prompt tokens a step that already carries `num_decode_tokens` decodes may add: what
        keeps the step near `target_step_ms` by the step-time model, else what is left of
        max_num_batched_tokens."""
        if self.step_cost is None or self.burst:
            return self.max_num_batched_tokens - num_decode_tokens
        return self.step_cost.prefill_budget(num_decode_tokens)

    def _update_burst(self, prefills_running: bool) -> None:
        """A burst starts when the waiting prompts hold more tokens than one step of
        max_num_batched_tokens, and ends when no prompt is waiting or part-way through its
        prefill. During a burst prompt chunks fill max_num_batched_tokens, as vLLM's do: small
        steps would pay the fixed cost of a step (weights, every running decode) many more
        times per prompt token and push the queue's first tokens back by that much (see
        docs/architecture.md, "The step budget under a burst")."""
        if self.step_cost is None:
            return
        if not self.burst and self.waiting.num_prompt_tokens > self.max_num_batched_tokens:
            self.burst = True
            logger.debug("burst: %d prompt tokens waiting", self.waiting.num_prompt_tokens)
        elif self.burst and not self.waiting and not prefills_running:
            self.burst = False
            logger.debug("burst over")

    def record_step_time(self, num_tokens: int, step_ms: float,
                         num_decode_tokens: int = 0) -> None:
        """The engine reports each step it ran: `num_tokens` scheduled tokens (of them
        `num_decode_tokens` decodes), `step_ms` wall milliseconds. Feeds the step-time model (a
        no-op without `target_step_ms`)."""
        model = self.step_cost
        if model is None:
            return
        measured = model.num_steps
        model.record(num_tokens, step_ms, num_decode_tokens)
        if model.num_steps != measured and model.num_steps % _LOG_FIT_EVERY == 0:
            fit = model.coefficients()
            if fit is not None:
                logger.info(
                    "step cost: %.2f ms + %.4f ms/prompt token + %.4f ms/decode token (%d steps "
                    "fitted, %d clamped); prompt budget %d tokens with no decodes, %d with 256",
                    fit.a, fit.bp, fit.bd, model.num_fitted, model.num_clamped,
                    model.prefill_budget(0), model.prefill_budget(256))

    def _num_new_tokens(self, num_wanted: int, budget: int) -> int:
        threshold = self.long_prefill_token_threshold
        if self.enable_chunked_prefill and 0 < threshold < num_wanted:
            num_wanted = threshold
        return min(num_wanted, budget)

    def _length_cap(self, request: Request) -> int:
        """Tokens the request can reach: prompt + max_tokens, at most max_model_len."""
        if request.max_tokens is None:
            return self.max_model_len
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _growth_blocks(self, request: Request) -> int:
        """Blocks a running request still needs to reach its length cap."""
        held = len(self.kv_cache_manager.get_block_ids(request.request_id))
        return max(cdiv(self._length_cap(request), self.block_size) - held, 0)

    def _pick_victim(self) -> Request:
        """The lowest-priority running request (priority policy), then the latest arrival."""
        by_priority = self.policy == "priority"

        def rank(item: tuple[int, Request]) -> tuple[int, float, int]:
            idx, request = item
            return (request.priority if by_priority else 0, request.arrival_time, idx)

        return max(enumerate(self.running), key=rank)[1]

    def _fail_request(self, request: Request, error: str) -> None:
        """Drops a waiting request that cannot run (its grammar failed to build); the next
        update_from_output reports it finished with reason "abort"."""
        logger.error("request %s aborted: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self._failed_outputs.append(EngineCoreOutput(
            request.request_id, [], request.get_finish_reason(), None, None, None, 0))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Admission underestimated the growth: reserve more from now on.
        self.growth_ratio = min(1.0, self.growth_ratio + _PREEMPTION_BUMP)
        self.finished_req_ids.add(request.request_id)  # the runner drops its state
        self.waiting.prepend(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _make_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[int]],
        num_decode_tokens: int = 0,
    ) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                pooling_params=r.pooling_params,
                block_ids=list(kv.get_block_ids(r.request_id)),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in scheduled_new
        ]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=[new_block_ids[r.request_id] for r in scheduled_running],
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
        )
        structured_ids: list[str] = []
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            structured_output_request_ids=structured_ids,
            num_decode_tokens=num_decode_tokens,
        )
        self.finished_req_ids = set()
        # The tokens count as computed from now on (prompt blocks were cached in schedule();
        # decode blocks are, once their token ids land, in update_from_output). A
        # request scheduled up to its last token samples one: a placeholder until it lands.
        for request in (*scheduled_running, *scheduled_new):
            request.num_computed_tokens += num_scheduled[request.request_id]
            if request.num_computed_tokens == (request.num_tokens
                                               + request.num_output_placeholders):
                if request.pooling_params is None:  # a pooling request samples nothing
                    request.num_output_placeholders += 1
                if request.structured_output_request is not None:
                    structured_ids.append(request.request_id)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop checks, caches computed blocks, frees finished
        requests. Returns one EngineCoreOutput per request with new tokens, prompt logprobs, or
        a finish."""
        row_of = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        sampled_token_ids = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs or {}
        pooled = runner_output.pooled
        outputs: list[EngineCoreOutput] = self._failed_outputs
        self._failed_outputs = []
        stopped = False
        # Per-request work runs for every request on every step: hoist what the loop reads.
        get_request, get_row = self.requests.get, row_of.get
        kv = self.kv_cache_manager
        caching, num_cached_blocks = kv.enable_caching, kv.num_cached_blocks
        block_size = self.block_size
        max_model_len = self.max_model_len
        last_unfinished, running_status = RequestStatus.PREEMPTED, RequestStatus.RUNNING
        # Matchers advance together after the loop (a batch call past a few rows).
        grammar_steps: list[tuple[str, StructuredOutputRequest, list[int]]] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = get_request(req_id)
            if request is None or request.status > last_unfinished:
                continue  # finished or aborted after it was scheduled
            row = get_row(req_id)
            sampled = sampled_token_ids[row] if row is not None else []
            if request.num_output_placeholders:
                request.num_output_placeholders = max(0, request.num_output_placeholders
                                                      - len(sampled))
            running = request.status == running_status
            if running and caching:
                # The step wrote these tokens' KV: their full blocks may now serve other
                # requests (only tokens whose ids are known: later ones are still in flight).
                # Most steps fill no block: that check is inlined.
                num_known = min(request.num_computed_tokens, len(request.all_token_ids))
                num_cached = num_cached_blocks.get(req_id)
                if num_cached is not None and num_known // block_size > num_cached:
                    kv.cache_blocks(request, num_known)
            # (A request preempted while this step was in flight still takes its token.)
            new_token_ids: list[int] = []
            if sampled:
                outputs_of, all_of = request.output_token_ids, request.all_token_ids
                for token_id in sampled:
                    outputs_of.append(token_id)
                    all_of.append(token_id)
                    new_token_ids.append(token_id)
                    if check_stop(request, max_model_len):
                        stopped = True
                        break
            if new_token_ids and request.structured_output_request is not None:
                grammar_steps.append((req_id, request.structured_output_request,
                                      new_token_ids))
            new_prompt_logprobs = None
            if prompt_logprobs:
                new_prompt_logprobs = self._new_prompt_logprobs(
                    request, num_tokens, prompt_logprobs.get(req_id))
            pooled_data = pooled.get(req_id) if pooled else None
            if pooled_data is not None:  # a pooling request's prompt has run: it is done
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            finished = request.status > last_unfinished
            if new_token_ids or new_prompt_logprobs is not None or finished:
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_token_ids,
                        request.get_finish_reason() if finished else None,
                        request.stop_reason,
                        logprobs[row] if row is not None and logprobs else None,
                        new_prompt_logprobs,
                        max(request.num_cached_tokens, 0),
                        pooled_data,
                    )
                )
            if finished:
                if not running:
                    self.waiting.remove(request)
                self._free_request(request)
        if grammar_steps:
            accept_sampled(grammar_steps)
        if stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    @staticmethod
    def _new_prompt_logprobs(request: Request, num_tokens: int,
                             entry: Optional[LogprobsLists]) -> Optional[LogprobsLists]:
        """Drops the prompt positions already returned before a preemption (the runner recomputes
        them). The entry covers positions [start, stop) of this step's chunk."""
        if entry is None:
            return None
        start = request.num_computed_tokens - num_tokens
        stop = min(request.num_computed_tokens, request.num_prompt_tokens - 1)
        skip = request.num_prompt_logprobs_done - start
        request.num_prompt_logprobs_done = max(request.num_prompt_logprobs_done, stop)
        if skip <= 0:
            return entry
        if skip >= stop - start:
            return None
        return entry.slice(skip, stop - start)
