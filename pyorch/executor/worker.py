"""A worker: one rank of the model, with its model runner (vLLM's Worker).

The same class runs in the engine core's process (uniproc), in a worker process (mp) and in a
Ray actor. `init_device` joins torch.distributed (gloo on the CPU, NCCL on CUDA) and the
tensor-parallel group; everything after that is the model runner's.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from pyorch import envs
from pyorch.config import EngineConfig
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.executor.model_runner import ModelRunner
from pyorch.executor.step import ModelRunnerOutput, StepHandle
from pyorch.structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)


def cpu_threads(world_size: int) -> Optional[int]:
    """The intra-op thread count of one CPU rank: ranks on one host share its cores, each an equal
    part; None where the user chose with OMP_NUM_THREADS, which torch has read already."""
    if envs.OMP_NUM_THREADS:
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


class Worker:
    """Rank `rank` of `world_size`; `local_rank` is its GPU on this host."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int,
                 distributed_init_method: str) -> None:
        self.config = config  # the worker's own copy (unpickled in its process)
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.world_size = config.parallel_config.world_size
        mc = self.config.model_config
        if mc.device.startswith("cuda"):
            mc.device = f"cuda:{local_rank}"
        self.model_runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"worker {self.rank}: init_device() has not run")
        return self.model_runner

    def init_device(self) -> None:
        """Binds the GPU (or CPU threads), joins the process group and builds the runner."""
        from pyorch.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        mc = self.config.model_config
        if mc.device.startswith("cuda"):
            torch.cuda.set_device(self.local_rank)
            backend = "nccl"
        else:
            threads = cpu_threads(self.world_size)
            if threads is not None:
                torch.set_num_threads(threads)
            backend = "gloo"
        if self.world_size > 1:
            init_distributed_environment(self.world_size, self.rank,
                                         self.distributed_init_method, self.local_rank, backend)
            pc = self.config.parallel_config
            initialize_model_parallel(pc.tensor_parallel_size, pc.enable_expert_parallel,
                                      pc.expert_placement_strategy)
            if backend == "nccl":
                self._init_custom_all_reduce()
        self.model_runner = ModelRunner(self.config)

    def _init_custom_all_reduce(self) -> None:
        """Sets up pyorch's custom all-reduce for the group when the GPUs can use it."""
        from pyorch.distributed.custom_all_reduce import CustomAllreduce
        from pyorch.distributed.parallel_state import get_tp_group

        if self.config.parallel_config.disable_custom_all_reduce:
            return
        group = get_tp_group()
        group.device_communicator = CustomAllreduce.create(group)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> int:
        return self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> StepHandle:
        return self.runner.execute_model(scheduler_output, grammar)

    def resolve(self, handle: StepHandle) -> ModelRunnerOutput:
        return self.runner.resolve(handle)

    def execute(self, scheduler_output: SchedulerOutput,
                grammar: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        """Runs a step and waits for its tokens."""
        return self.runner.execute(scheduler_output, grammar)

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes()

    def ping(self) -> int:
        return self.rank

    def profile(self, is_start: bool, trace_path: Optional[str] = None) -> Optional[str]:
        """vLLM's Worker.profile: starts torch.profiler (CPU and CUDA activity) on this rank, or
        stops it and returns its table of kernels and ops by device time (and writes a Chrome
        trace to trace_path, whose `{rank}` becomes this rank). bench/profile_gpu.py calls it
        on every rank under tensor parallelism, where the model runs in the workers."""
        from torch.profiler import ProfilerActivity, profile

        if is_start:
            if getattr(self, "_profiler", None) is not None:
                raise RuntimeError(f"rank {self.rank}: the profiler is already running")
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler: Any = profile(activities=activities)
            self._profiler.__enter__()
            return None
        prof, self._profiler = getattr(self, "_profiler", None), None
        if prof is None:
            raise RuntimeError(f"rank {self.rank}: the profiler was not started")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        if trace_path:
            prof.export_chrome_trace(trace_path.replace("{rank}", str(self.rank)))
        table: str = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30,
                                               max_name_column_width=60)
        return table

    def expert_placement(self) -> list[tuple[int, int, list[int]]]:
        """Per MoE layer of this rank's model: (expert-parallel size, intermediate columns
        held per expert, the global expert ids held), for logs and tests."""
        from pyorch.layers.fused_moe import FusedMoE

        model = self.runner.model
        if model is None:
            raise RuntimeError(f"worker {self.rank}: the model is not loaded")
        return [(m.ep_size, m.intermediate_size_per_partition, list(m.local_expert_ids))
                for m in model.modules() if isinstance(m, FusedMoE)]

    def get_timings(self) -> Any:
        return self.runner.timings

    def shutdown(self) -> None:
        from pyorch.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
