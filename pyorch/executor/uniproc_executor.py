"""The executor of one GPU or the CPU: the model runner in the engine core's own process."""

from __future__ import annotations

from typing import Any, Optional

from pyorch.config import EngineConfig
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.executor.abstract import Executor
from pyorch.executor.model_runner import ModelRunner
from pyorch.executor.step import ModelRunnerOutput, StepHandle
from pyorch.structured_output.manager import GrammarOutput


class UniProcExecutor(Executor):
    """No processes, no pickling: calls go straight to the runner."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.model_runner = ModelRunner(config)
        self.timings = self.model_runner.timings

    def initialize(self) -> int:
        self.model_runner.load_model()
        return self.model_runner.initialize_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> StepHandle:
        return self.model_runner.execute_model(scheduler_output, grammar)

    def resolve(self, handle: Any) -> ModelRunnerOutput:
        return self.model_runner.resolve(handle)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.model_runner, method)(*args)]

    def shutdown(self) -> None:
        """Frees the runner's model, KV cache and CUDA graphs (idempotent)."""
        self.model_runner.release()
