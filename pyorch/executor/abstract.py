"""The executor: where the engine core's steps run (vLLM's Executor).

`EngineCore` talks to one `Executor`; it never sees worker processes. An executor loads the
model, sizes and binds the KV cache (`initialize`), launches a step (`execute_model`, returning a
handle without waiting for the device), and hands back the sampled tokens (`resolve`, in launch
order). Three kinds, picked by `distributed_executor_backend`:

- `uni` (`UniProcExecutor`): the model runner in the engine core's process; one GPU or the CPU.
- `mp` (`MultiprocExecutor`): one worker process per rank on this host, the scheduler output
  broadcast through shared memory, torch.distributed between the workers.
- `ray` (`RayDistributedExecutor`): the same workers as Ray actors in a placement group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from pyorch.config import EngineConfig, ParallelConfig
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.executor.step import ModelRunnerOutput
from pyorch.metrics.stats import StepTimings
from pyorch.structured_output.manager import GrammarOutput


class Executor(ABC):
    """Runs the engine's steps on one or more workers."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Host time per phase of a step as the engine core sees it (workers keep their own).
        self.timings = StepTimings()

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type["Executor"]:
        backend = parallel_config.distributed_executor_backend
        if backend == "uni":
            from pyorch.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pyorch.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from pyorch.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(f"unknown distributed_executor_backend {backend!r}")

    def initialize(self) -> int:
        """Loads the model on every worker, sizes the KV cache (the smallest over the ranks),
        allocates it and captures CUDA graphs. Returns the number of KV blocks."""
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")
        num_blocks = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> Any:
        """Launches one step (`grammar`: the structured-output bitmask of its constrained
        rows, or None); returns a handle for `resolve` without waiting for the device."""

    @abstractmethod
    def resolve(self, handle: Any) -> ModelRunnerOutput:
        """The sampled tokens of a launched step (handles resolve in launch order)."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Calls `method(*args)` on every worker; returns their results in rank order."""

    def check_health(self) -> None:
        """Raises when a worker is gone."""
        return None

    def shutdown(self) -> None:
        """Stops the workers and frees what the executor holds (idempotent)."""
        return None
