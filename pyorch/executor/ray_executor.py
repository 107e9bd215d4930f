"""The ray executor: the workers as Ray actors in a placement group (several hosts).

One bundle per rank ({"GPU": 1, "CPU": 1} on CUDA, {"CPU": 1} on the CPU), packed onto as few
hosts as the cluster allows; rank 0's host gives torch.distributed its rendezvous address. The
engine core puts each step's SchedulerOutput into Ray's object store once (`ray.put`) and every
actor reads it from there; each actor runs the step and returns its runner output, of which the
engine keeps rank 0's.

Where `ray.init` was not called, the executor calls it (joining RAY_ADDRESS's cluster, else
starting a local one) and stops it at shutdown. Ray pins each actor to its GPU
(CUDA_VISIBLE_DEVICES), so the custom all-reduce, which maps the other GPUs' memory, is not
used: all-reduces go to NCCL.
A dead actor fails the next wait with `WorkerDiedError`, never a hang.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import pyorch
from pyorch.config import EngineConfig
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.distributed.parallel_state import WORKER_ENV_DEFAULTS, worker_env
from pyorch.executor.abstract import Executor
from pyorch.executor.multiproc_executor import WorkerDiedError
from pyorch.executor.step import ModelRunnerOutput
from pyorch.structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


class RayWorkerWrapper:
    """The actor class: a Worker made in the actor, called by method name."""

    def __init__(self) -> None:
        self.worker: Any = None

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        import ray

        from pyorch.executor.multiproc_executor import get_open_port

        return ray.util.get_node_ip_address(), get_open_port()

    def init_worker(self, config: EngineConfig, rank: int, local_rank: int,
                    distributed_init_method: str) -> None:
        from pyorch.executor.worker import Worker

        self.worker = Worker(config, rank, local_rank, distributed_init_method)

    def execute_method(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute(self, step: tuple[SchedulerOutput, Optional[GrammarOutput]]
                ) -> ModelRunnerOutput:
        """One step: (scheduler output, structured-output bitmask or None)."""
        return self.worker.execute(*step)


@dataclass
class _RayStepHandle:
    refs: list[Any]  # one ObjectRef of a ModelRunnerOutput per rank


class RayDistributedExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        try:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs the ray package: "
                              "pip install ray") from e
        self._ray = ray
        self._started_ray = False
        self._closed = False
        if not ray.is_initialized():
            # Ray joins the cluster named by RAY_ADDRESS itself, else starts a local one.
            ray.init(include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        self.world_size = config.parallel_config.world_size
        on_gpu = config.model_config.device.startswith("cuda")
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": 1.0}
        self.placement_group = ray.util.placement_group([bundle] * self.world_size,
                                                        strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {self.world_size} workers of {bundle} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}")
        root = os.path.dirname(os.path.dirname(os.path.abspath(pyorch.__file__)))
        env = dict(os.environ)
        pythonpath = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Ray gives its actors the raylet's environment: pass the worker defaults explicitly.
        defaults = {k: worker_env(env)[k] for k in WORKER_ENV_DEFAULTS}
        actor_cls = ray.remote(RayWorkerWrapper)
        self.actors: list[Any] = [
            actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {**defaults, "PYTHONPATH": pythonpath}},
            ).remote()
            for rank in range(self.world_size)
        ]
        ip, port = self._get(self.actors[0].get_node_ip_and_free_port.remote())
        # Ray shows each actor only its own GPU: every rank's device is its local 0, and the
        # custom all-reduce (which maps the peers' memory) cannot run.
        init_method = f"tcp://{ip}:{port}"
        if on_gpu:
            config.parallel_config.disable_custom_all_reduce = True
        self._get_all([actor.init_worker.remote(config, rank, 0, init_method)
                       for rank, actor in enumerate(self.actors)])

    # ---- waiting ----------------------------------------------------------------------------
    def _get(self, ref: Any) -> Any:
        return self._get_all([ref])[0]

    def _get_all(self, refs: list[Any]) -> list[Any]:
        """Every result, raising as soon as any rank fails (a dead actor included): a rank
        blocked in a collective with a dead peer is never waited for."""
        ray = self._ray
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    rank = refs.index(ref)
                    raise WorkerDiedError(f"Ray worker rank {rank} died: {e}") from e
                except ray.exceptions.RayTaskError as e:
                    rank = refs.index(ref)
                    raise RuntimeError(f"Ray worker rank {rank} failed: {e}") from e
        return [ray.get(ref) for ref in refs]

    # ---- calls ------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._get_all([a.execute_method.remote(method, *args) for a in self.actors])

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> _RayStepHandle:
        start = time.perf_counter()
        ref = self._ray.put((scheduler_output, grammar))  # serialized once for every actor
        handle = _RayStepHandle([a.execute.remote(ref) for a in self.actors])
        self.timings.launch += time.perf_counter() - start
        return handle

    def resolve(self, handle: Any) -> ModelRunnerOutput:
        start = time.perf_counter()
        outputs = self._get_all(handle.refs)
        self.timings.wait += time.perf_counter() - start
        return outputs[0]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "placement_group", None) is not None:
            ray.util.remove_placement_group(self.placement_group)
        if self._started_ray:
            ray.shutdown()
