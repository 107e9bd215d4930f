"""AsyncLLM: the asyncio front end of the serving engine (vLLM's `AsyncLLM`).

Processes: this object lives in the API-server process and keeps tokenization, n > 1 fan-out,
incremental detokenization and stop strings there (InputProcessor, OutputProcessor); the model,
the KV cache and the scheduler run in the engine-core process (`pyorch.core.core_proc`), reached
through an `EngineCoreClient` in the wire protocol of `pyorch.wire`; this process never imports
`pyorch.core`. One asyncio task (the output handler) reads the core's per-step batches,
turns them into RequestOutputs, routes them to per-request streams and feeds the stat loggers.
Concurrent `generate()` calls are batched by the core: every ADD that arrived before a step
joins that step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any, AsyncGenerator, Optional, Union

from pyorch import wire
from pyorch.config import EngineConfig, ModelConfig
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.core_client import EngineCoreClient
from pyorch.engine.exceptions import EngineDeadError
from pyorch.engine.input_processor import InputProcessor, PromptType
from pyorch.engine.output_processor import OutputProcessor
from pyorch.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase, record_stats
from pyorch.outputs import RequestOutput
from pyorch.pooling_outputs import PoolingRequestOutput
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class _RequestStream:
    """Outputs of one request waiting for its consumer; a slow consumer gets them merged."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.delta = output_kind == RequestOutputKind.DELTA
        self.items: deque[Union[RequestOutput, PoolingRequestOutput, BaseException]] = deque()
        self.ready = asyncio.Event()

    def put(self, item: Union[RequestOutput, PoolingRequestOutput, BaseException]) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self) -> Union[RequestOutput, PoolingRequestOutput]:
        await self.ready.wait()
        self.ready.clear()
        merged: Optional[Union[RequestOutput, PoolingRequestOutput]] = None
        while self.items:
            item = self.items.popleft()
            if isinstance(item, BaseException):
                raise item
            if (merged is None or not self.delta or not isinstance(item, RequestOutput)
                    or not isinstance(merged, RequestOutput)):
                merged = item  # cumulative outputs: the newest holds everything
                continue
            if item.prompt_logprobs:
                merged.prompt_logprobs = (merged.prompt_logprobs or []) + item.prompt_logprobs
            merged.add(item, aggregate=True)
        assert merged is not None
        return merged


class AsyncLLM:
    """The serving engine's front end. Build it with `from_engine_args` (synchronous: returns
    once the engine-core process has loaded the model and sized the KV cache)."""

    def __init__(self, config: EngineConfig,
                 stat_loggers: Optional[list[StatLoggerBase]] = None) -> None:
        self.config = config
        mc = config.model_config
        # The core loads the model while this process loads the tokenizer.
        self.engine_core = EngineCoreClient(config)
        self.tokenizer: Any = None
        if not mc.skip_tokenizer_init:
            from pyorch.model_loader import get_tokenizer

            try:
                # The tokenizer path, else the model's (ModelConfig.resolve() fills it in).
                self.tokenizer = get_tokenizer(mc.model, mc.tokenizer, revision=mc.revision,
                                               trust_remote_code=mc.trust_remote_code,
                                               tokenizer_mode=mc.tokenizer_mode)
            except BaseException:
                self.engine_core.shutdown()
                raise
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = self.input_processor.eos_token_id()
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers or [])
        self.dead_error: Optional[BaseException] = None
        self._is_shut_down = False
        self._streams: dict[str, _RequestStream] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._pending_stats = IterationStats()  # aborts land in the next step's record
        self._output_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

        info = self.engine_core.wait_ready()
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self.block_size: int = info["block_size"]
        self.kv_cache_capacity_tokens: int = info["num_usable_blocks"] * self.block_size
        config.cache_config.num_blocks = self.num_kv_blocks

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *,
                         stat_loggers: Optional[list[StatLoggerBase]] = None) -> "AsyncLLM":
        return cls(engine_args.create_engine_config(), stat_loggers)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def engine_core_pid(self) -> Optional[int]:
        """The engine-core process's pid (for operators and monitoring)."""
        return self.engine_core.pid

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return not self._is_shut_down and self.dead_error is None

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, priority: int = 0,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Streams a request's RequestOutputs (per `sampling_params.output_kind`); the last one
        has finished=True. A bad request raises ValueError/TypeError from the first `__anext__`,
        before anything is queued. Stopping early (aclose, cancellation) aborts the request."""
        self._check_alive()
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._streams or self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_text, token_ids, params = self.input_processor.process(
            prompt, sampling_params, priority)
        self._ensure_output_handler()
        arrival_time = time.time()
        children = self.output_processor.add_request(
            request_id, prompt_text, token_ids, params, self.eos_token_id,
            self.model_config.vocab_size, arrival_time)
        stream = _RequestStream(params.output_kind)
        self._streams[request_id] = stream
        finished = False
        try:
            for child_id, child_params in children:
                self.engine_core.add_request(child_id, token_ids, child_params, arrival_time,
                                             priority, self.eos_token_id)
            while not finished:
                output = await stream.get()
                assert isinstance(output, RequestOutput)  # generate() streams only these
                finished = output.finished
                yield output
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:  # consumer gone, cancelled, or an error: free the core's blocks
                self._abort_quietly(request_id)

    async def encode(self, prompt: PromptType, pooling_params: Optional[PoolingParams],
                     request_id: str, *, priority: int = 0,
                     ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yields a pooling request's one (finished) PoolingRequestOutput (runner='pooling').
        A bad request raises ValueError/TypeError from the first `__anext__`, before anything
        is queued; stopping early aborts the request."""
        self._check_alive()
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._streams or self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        _, token_ids, params = self.input_processor.process_pooling(
            prompt, pooling_params, priority)
        self._ensure_output_handler()
        arrival_time = time.time()
        self.output_processor.add_pooling_request(request_id, token_ids, arrival_time)
        stream = _RequestStream(RequestOutputKind.FINAL_ONLY)
        self._streams[request_id] = stream
        finished = False
        try:
            self.engine_core.add_request(request_id, token_ids, params, arrival_time, priority,
                                         self.eos_token_id)
            output = await stream.get()
            if not isinstance(output, PoolingRequestOutput):
                raise RuntimeError(f"request {request_id}: expected a pooling output")
            finished = True
            yield output
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._abort_quietly(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its generator yields a last output with finish_reason "abort"."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        child_ids, outputs = self.output_processor.finish_aborted(
            [request_id], self._pending_stats)
        if child_ids and self.dead_error is None and not self.engine_core.closed:
            self.engine_core.abort_requests(child_ids)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self._abort(request_id)
        except EngineDeadError:
            pass  # nothing left to free

    # ---- control -----------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine core is dead (or shut down)."""
        self._check_alive()

    async def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache; False (nothing dropped) while requests hold blocks."""
        return bool(await self._call(wire.RESET_PREFIX_CACHE))

    async def get_scheduler_stats(self) -> SchedulerStats:
        """A fresh SchedulerStats snapshot from the core."""
        return wire.decode_stats(await self._call(wire.UTILITY, "get_stats"))

    async def get_kv_cache_info(self) -> dict[str, Any]:
        """num_blocks, num_usable_blocks, num_free_blocks, block_size, kv_cache_usage,
        num_unfinished_requests, as the core sees them now."""
        return await self._call(wire.UTILITY, "get_kv_cache_info")

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Runs a named utility in the engine core (`core_proc.EngineCoreProc._utility`)."""
        return await self._call(wire.UTILITY, method, *args)

    async def _call(self, kind: int, *args: Any) -> Any:
        self._check_alive()
        self._ensure_output_handler()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            if kind == wire.UTILITY:
                method, *rest = args
                self.engine_core.send((kind, call_id, method, rest))
            else:
                self.engine_core.send((kind, call_id))
            return await future
        finally:
            self._utility_calls.pop(call_id, None)

    def shutdown(self) -> None:
        """Aborts in-flight requests (their generators end with finish_reason "abort"), stops
        and joins the engine-core process. Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        for request_id in list(self._streams):
            child_ids, outputs = self.output_processor.finish_aborted([request_id])
            for output in outputs:
                self._streams[request_id].put(output)
        if self._output_task is not None and not self._output_task.done():
            if self._loop is not None and not self._loop.is_closed():
                self._output_task.cancel()
        self.engine_core.shutdown()
        self._fail_calls(EngineDeadError("the engine was shut down"))

    # ---- the output handler ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error)) from self.dead_error
        if self._is_shut_down:
            raise EngineDeadError("the engine was shut down")
        if not self.engine_core.is_alive():
            self._set_dead(EngineDeadError(
                f"the engine-core process died (exit code {self.engine_core.exitcode})"))
            raise EngineDeadError(str(self.dead_error))

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_task
        if task is not None and not task.done() and self._loop is loop:
            return
        if task is not None and not task.done() and self._loop is not None \
                and not self._loop.is_closed():
            raise RuntimeError("AsyncLLM is already serving another running event loop")
        self._loop = loop
        self._output_task = loop.create_task(self._run_output_handler(),
                                             name="pyorch-output-handler")

    async def _run_output_handler(self) -> None:
        try:
            while self.dead_error is None:
                for msg in await self.engine_core.recv():
                    self._handle(msg)
        except asyncio.CancelledError:
            raise
        except (EOFError, OSError) as e:
            if self._is_shut_down:
                return
            for _ in range(40):  # give the process a moment to be reaped for its exit code
                if self.engine_core.exitcode is not None:
                    break
                await asyncio.sleep(0.05)
            self._set_dead(EngineDeadError(
                f"the engine-core process died (exit code {self.engine_core.exitcode}): {e}"))
        except Exception as e:
            logger.exception("the output handler failed")
            self._set_dead(EngineDeadError(f"the output handler failed: {e!r}"))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == wire.OUTPUTS:
            _, outputs, stats, _timestamp, scheduled_time, new_req_ids = msg
            self._process_step([wire.decode_output(o) for o in outputs],
                               wire.decode_stats(stats), scheduled_time, new_req_ids)
        elif kind == wire.UTILITY_RESULT:
            _, call_id, ok, value = msg
            future = self._utility_calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        elif kind == wire.REQUEST_ERROR:
            _, child_id, message = msg
            parent_id = self.output_processor.child_to_parent.get(child_id)
            if parent_id is None and child_id in self.output_processor.pooling:
                parent_id = child_id  # a pooling request: one id in both processes
            if parent_id is not None:
                child_ids = self.output_processor.abort_requests([parent_id])
                self.engine_core.abort_requests(child_ids)
                stream = self._streams.get(parent_id)
                if stream is not None:
                    stream.put(ValueError(message))
        elif kind == wire.ENGINE_ERROR:
            _, message, tb = msg
            logger.error("the engine core failed:\n%s", tb)
            self._set_dead(EngineDeadError(f"the engine core failed: {message}"))
        else:
            raise ValueError(f"unexpected engine-core message type {kind!r}")

    def _process_step(self, outputs: list, scheduler_stats: SchedulerStats,
                      scheduled_time: float, new_req_ids: list[str]) -> None:
        stats, self._pending_stats = self._pending_stats, IterationStats()
        self.output_processor.mark_scheduled(new_req_ids, scheduled_time)
        request_outputs, stopped = self.output_processor.process_outputs(outputs, stats)
        if stopped:  # stop strings found here: the core stops generating for them
            self.engine_core.finish_stopped(stopped)
        for output in request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        record_stats(self.stat_loggers, scheduler_stats, stats)

    def _set_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine is dead: %s", error)
        self.dead_error = error
        for stream in self._streams.values():
            stream.put(error)
        for request_id in list(self.output_processor.parents):
            self.output_processor.abort_requests([request_id])
        self._fail_calls(error)
        task = self._output_task
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop
            current = None
        if task is not None and task is not current and not task.done():
            if self._loop is not None and not self._loop.is_closed():
                task.cancel()
        self.engine_core.close_socket()

    def _fail_calls(self, error: BaseException) -> None:
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
