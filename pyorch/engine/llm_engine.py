"""LLMEngine: the offline (in-process) engine. It keeps tokenization and output processing in
front of an in-process `EngineCore`; one `step()` is the core's step (schedule -> execute ->
update_from_output) followed by detokenization into RequestOutputs.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Iterable, Optional, Union

from pyorch.config import EngineConfig
from pyorch.core.engine_core import EngineCore
from pyorch.core.request import Request, RequestStatus
from pyorch.core.scheduler import Scheduler
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.input_processor import MAX_LOGPROBS, InputProcessor, PromptType
from pyorch.engine.output_processor import OutputProcessor
from pyorch.executor.model_runner import ModelRunner
from pyorch.metrics.stats import IterationStats, StatLoggerBase, record_stats
from pyorch.outputs import RequestOutput
from pyorch.pooling_outputs import PoolingRequestOutput
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "MAX_LOGPROBS"]


class LLMEngine:
    """Offline engine: `add_request` / `step` / `abort_request` over an in-process EngineCore.

    stat_loggers: each gets `record(scheduler_stats, iteration_stats)` after every step; a
    logger that raises is logged and skipped.
    """

    def __init__(self, config: EngineConfig,
                 stat_loggers: Optional[list[StatLoggerBase]] = None):
        self.config = config
        mc = config.model_config
        self.tokenizer = None
        if not mc.skip_tokenizer_init:
            from pyorch.model_loader import get_tokenizer

            # The tokenizer path, else the model's (ModelConfig.resolve() fills it in already).
            self.tokenizer = get_tokenizer(mc.model, mc.tokenizer,
                                           trust_remote_code=mc.trust_remote_code,
                                           revision=mc.revision,
                                           tokenizer_mode=mc.tokenizer_mode)
        self.engine_core = EngineCore(config)
        # The core sits in reference cycles (the model's parameters hold their modules' bound
        # weight loaders), so dropping the engine would keep its weights, KV cache and workers
        # until the next garbage collection. Shut the core down when the engine goes.
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)
        self._finalizer.atexit = False
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = self.input_processor.eos_token_id()
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers or [])
        self._pending_stats = IterationStats()  # aborts between steps land in the next record

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         stat_loggers: Optional[list[StatLoggerBase]] = None) -> "LLMEngine":
        return cls(engine_args.create_engine_config(), stat_loggers)

    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def model_runner(self) -> ModelRunner:
        return self.engine_core.model_runner

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[Union[SamplingParams, PoolingParams]] = None,
                    arrival_time: Optional[float] = None, priority: int = 0) -> None:
        """Validates and queues a request (raises ValueError on a bad one; nothing is queued).
        PoolingParams make a pooling request (runner='pooling')."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams) or (params is None
                                                 and self.config.model_config.is_pooling):
            self._add_pooling_request(request_id, prompt, params, arrival_time, priority)
            return
        prompt_text, token_ids, params = self.input_processor.process(prompt, params, priority)
        children = self.output_processor.add_request(
            request_id, prompt_text, token_ids, params, self.eos_token_id,
            self.config.model_config.vocab_size, arrival_time)
        added: list[str] = []
        try:
            for child_id, child_params in children:
                self.engine_core.add_request(Request(
                    request_id=child_id, prompt_token_ids=token_ids, sampling_params=child_params,
                    eos_token_id=self.eos_token_id, arrival_time=arrival_time, priority=priority))
                added.append(child_id)
        except Exception:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests([request_id])
            raise

    def _add_pooling_request(self, request_id: str, prompt: PromptType,
                             params: Optional[PoolingParams], arrival_time: float,
                             priority: int) -> None:
        _, token_ids, resolved = self.input_processor.process_pooling(prompt, params, priority)
        self.output_processor.add_pooling_request(request_id, token_ids, arrival_time)
        try:
            self.engine_core.add_request(Request(
                request_id=request_id, prompt_token_ids=token_ids,
                sampling_params=SamplingParams(), eos_token_id=self.eos_token_id,
                arrival_time=arrival_time, priority=priority, pooling_params=resolved))
        except Exception:
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = self.output_processor.abort_requests(ids, self._pending_stats)
        self.engine_core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        core_out = self.engine_core.step()
        start = time.perf_counter()
        stats, self._pending_stats = self._pending_stats, IterationStats()
        self.output_processor.mark_scheduled(core_out.scheduled_new_req_ids,
                                             core_out.scheduled_time)
        outputs, stopped = self.output_processor.process_outputs(core_out.outputs, stats)
        if stopped:  # stop strings found by the detokenizer
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        record_stats(self.stat_loggers, core_out.scheduler_stats, stats)
        self.engine_core.timings.output += time.perf_counter() - start
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Frees the model and KV cache and stops the engine core's workers (tensor
        parallelism); idempotent. Dropping the engine does the same."""
        self._finalizer.detach()
        self.engine_core.shutdown()

