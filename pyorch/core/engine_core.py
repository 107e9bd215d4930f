"""EngineCore: the scheduler and the model runner behind one `step()`, with no tokenizer.

One step is three calls: `scheduler.schedule()` -> `model_executor.execute_model(...)` (then
`resolve`) -> `scheduler.update_from_output(...)`. The executor (`pyorch.executor.abstract`) runs
the model runner in this process, or in one worker process (or Ray actor) per
tensor-parallel rank. The core takes `Request`s of token ids and returns, per
step, an `EngineCoreOutputs` batch (new token ids, finishes, logprobs) and a `SchedulerStats`
snapshot. Tokenization, detokenization, stop strings and n > 1 fan-out live in the front end
(`LLMEngine` in-process, or `AsyncLLM` talking to `pyorch.core.core_proc` in another process),
which calls `finish_requests(ids, FINISHED_STOPPED)` when it finds a stop string.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from pyorch.config import EngineConfig
from pyorch.core.request import Request, RequestStatus
from pyorch.core.scheduler import Scheduler
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.core_types import EngineCoreOutput
from pyorch.executor.abstract import Executor
from pyorch.executor.model_runner import ModelRunner
from pyorch.metrics.stats import SchedulerStats
from pyorch.structured_output.manager import GrammarOutput, StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutputs:
    """What one step produced: per-request outputs, a stats snapshot and timing."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float = 0.0  # time.time() when the step ended
    scheduled_time: float = 0.0  # time.time() when the step was scheduled
    # Requests that (re)entered the batch this step: new ones and ones resumed after preemption.
    scheduled_new_req_ids: list[str] = field(default_factory=list)


class EngineCore:
    """Loads the model and the KV cache, then runs steps over the queued requests."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_executor = Executor.get_class(config.parallel_config)(config)
        try:
            num_blocks = self.model_executor.initialize()
        except BaseException:
            self.model_executor.shutdown()
            raise
        config.cache_config.num_blocks = num_blocks
        self.scheduler = Scheduler.from_config(
            config.scheduler_config, config.cache_config, num_blocks
        )
        self.num_steps = 0
        self.timings = self.model_executor.timings  # host/device time per phase (benchmarks)
        # Async scheduling: step N+1 is scheduled and launched before step N's tokens are read.
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._in_flight: Optional[tuple[SchedulerOutput, Any, float]] = None
        self._last_step_done = 0.0  # perf_counter() when the last step's tokens were read
        self.structured_output_manager = StructuredOutputManager(
            self._load_tokenizer, config.model_config.vocab_size)

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer, for xgrammar (loaded on the first constrained request)."""
        from pyorch.model_loader import get_tokenizer

        mc = self.config.model_config
        return get_tokenizer(mc.model, mc.tokenizer, trust_remote_code=mc.trust_remote_code,
                             revision=mc.revision)

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process model runner (the uni executor's; workers hold their own)."""
        runner = getattr(self.model_executor, "model_runner", None)
        if runner is None:
            raise AttributeError(
                f"{type(self.model_executor).__name__} runs the model in worker processes: "
                "there is no model runner in the engine core")
        return runner

    def shutdown(self) -> None:
        """Stops the executor's workers (idempotent)."""
        self.model_executor.shutdown()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request (ValueError, nothing queued, if it can never run, or if it is a
        pooling request to a generating engine or the other way round). A request with
        structured_outputs starts compiling its grammar; it is scheduled once that is done."""
        if self.config.model_config.is_pooling != (request.pooling_params is not None):
            raise ValueError(
                "this engine serves a pooling model: it only takes pooling requests "
                "(embed/encode/score)" if self.config.model_config.is_pooling else
                "this engine serves a generative model (runner='generate'): pooling requests "
                "need runner='pooling'")
        if request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Drops requests wherever they are and frees their blocks (unknown ids are ignored)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finishes requests with `status` (e.g. FINISHED_STOPPED for a stop string)."""
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One engine step. Synchronous: schedule, run, wait, update. With async scheduling the
        step schedules and launches the next batch first, then waits for the batch launched by
        the previous call and returns its outputs (so host work overlaps the device's)."""
        scheduled_time = time.time()
        if not self.async_scheduling:
            launched = time.perf_counter()
            scheduler_output, grammar = self._schedule()
            handle = self.model_executor.execute_model(scheduler_output, grammar)
            return self._finish(scheduler_output, handle, launched, scheduled_time,
                                scheduler_output)
        previous = self._in_flight
        if previous is not None and self._must_wait_first():
            self._in_flight = None
            return self._finish(*previous, scheduled_time, None)
        launched = time.perf_counter()
        scheduler_output, grammar = self._schedule()
        handle = self.model_executor.execute_model(scheduler_output, grammar)
        self._in_flight = (scheduler_output, handle, launched)
        if previous is None:  # the pipeline fills: this step is counted when it finishes
            return EngineCoreOutputs(
                outputs=[], scheduler_stats=self.scheduler.make_stats(), timestamp=time.time(),
                scheduled_time=scheduled_time,
                scheduled_new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs])
        return self._finish(*previous, scheduled_time, scheduler_output)

    def _schedule(self) -> tuple[SchedulerOutput, Optional[GrammarOutput]]:
        """The step's batch and, when constrained rows sample in it, their token bitmask
        (filled here, after the previous step's tokens advanced the matchers: a constrained
        request makes the step wait for the previous one, see _must_wait_first)."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        grammar = self.structured_output_manager.grammar_bitmask(
            self.scheduler.requests, scheduler_output.structured_output_request_ids)
        if not scheduler_output.total_num_scheduled_tokens and self.scheduler.waiting:
            # Nothing could run: maybe only grammars still compiling. Wait for one briefly
            # rather than spin (the core's loop steps while requests are unfinished).
            self.structured_output_manager.wait_for_compiles(list(self.scheduler.waiting),
                                                             timeout=0.005)
        self.timings.schedule += time.perf_counter() - start
        return scheduler_output, grammar

    def _finish(self, scheduler_output: SchedulerOutput, handle: Any, launched: float,
                scheduled_time: float,
                newly_scheduled: Optional[SchedulerOutput]) -> EngineCoreOutputs:
        start, waited = time.perf_counter(), self.timings.wait
        runner_output = self.model_executor.resolve(handle)
        self._record_step_time(scheduler_output, launched)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.timings.update += time.perf_counter() - start - (self.timings.wait - waited)
        self.num_steps += 1
        self.timings.steps += 1
        new_ids = [r.req_id for r in newly_scheduled.scheduled_new_reqs] if newly_scheduled else []
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.scheduler.make_stats(),
            timestamp=time.time(),
            scheduled_time=scheduled_time,
            scheduled_new_req_ids=new_ids,
        )

    def _record_step_time(self, scheduler_output: SchedulerOutput, launched: float) -> None:
        """Tells the scheduler how long the step took: from when it was scheduled, or when the
        step before it landed if that was later (with async scheduling the device starts a step
        when the previous one ends), to when its tokens landed."""
        done = time.perf_counter()
        step_ms = (done - max(launched, self._last_step_done)) * 1e3
        self._last_step_done = done
        self.scheduler.record_step_time(scheduler_output.total_num_scheduled_tokens, step_ms,
                                        scheduler_output.num_decode_tokens)

    def _must_wait_first(self) -> bool:
        """Whether the in-flight step must land before the next is scheduled: some running
        request samples from its token history (penalties, bad words, min_tokens) or returns
        prompt logprobs, which the host must see up to date; or nothing is left to schedule."""
        running = self.scheduler.running
        if not running and not self.scheduler.waiting:
            return True
        return any(r.needs_token_history for r in running)

    # ---- control and introspection -----------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache; False (nothing dropped) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def get_kv_cache_info(self) -> dict[str, Any]:
        """Block counts of the KV pool (num_blocks includes the null block)."""
        kv = self.scheduler.kv_cache_manager
        return {
            "num_blocks": kv.num_blocks,
            "num_usable_blocks": kv.num_usable_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "block_size": kv.block_size,
            "kv_cache_usage": kv.usage,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests(),
        }

    def ready_info(self) -> dict[str, Any]:
        """What a front end needs to know once the core is up (sent with READY)."""
        mc, sc = self.config.model_config, self.config.scheduler_config
        kv = self.scheduler.kv_cache_manager
        return {
            "num_kv_blocks": kv.num_blocks,
            "num_usable_blocks": kv.num_usable_blocks,
            "block_size": kv.block_size,
            "max_model_len": sc.max_model_len,
            "vocab_size": mc.vocab_size,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "device": str(mc.device),
            "dtype": str(mc.dtype),
        }
