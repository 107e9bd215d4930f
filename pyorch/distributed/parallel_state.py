"""Process groups of one engine: the world of workers and its tensor-parallel group.

Each worker process calls `init_distributed_environment` (torch.distributed: gloo on the CPU,
NCCL on CUDA) and then `initialize_model_parallel(tensor_parallel_size)`. Layers ask for their
position with `get_tensor_model_parallel_rank()` / `..._world_size()`; a process that never set
up a group (one GPU, the CPU engine in-process) is rank 0 of 1, and no collective runs then.

Pipeline parallelism is not offered, so the tensor-parallel group is the whole world.

Expert parallelism (`enable_expert_parallel`): the MoE layers place whole experts on the ranks of
the expert-parallel group instead of sharding every expert's intermediate dimension. Its size is
TP x DP (vLLM's rule); without data parallelism that is the tensor-parallel group itself, so the
EP group is the TP group and the layers' all-reduce combines the experts' partial outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process group and this process's place in it.

    `device_communicator` is the custom all-reduce (pyorch.distributed.custom_all_reduce) when
    one was set up for a CUDA group; collectives it cannot take go to torch.distributed.
    """

    ranks: list[int]
    rank_in_group: int
    group: Any  # torch.distributed ProcessGroup (None: a group of one)
    device: torch.device
    device_communicator: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group: the custom all-reduce's new tensor, else x summed in place
        by torch.distributed (a copy first if x is not contiguous); x itself in a group of one."""
        if self.world_size == 1:
            return x
        comm = self.device_communicator
        if comm is not None and x.is_cuda:
            out = comm.all_reduce(x)
            if out is not None:
                return out
        out = x.clone() if not x.is_contiguous() else x
        dist.all_reduce(out, group=self.group)
        return out

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> Optional[torch.Tensor]:
        """The custom communicator's fused all-reduce + residual add + RMSNorm (residual updated
        in place, the normed output returned), or None where it does not take x: then nothing
        has happened and the caller reduces and norms separately."""
        comm = self.device_communicator
        if self.world_size == 1 or comm is None or not x.is_cuda:
            return None
        out: Optional[torch.Tensor] = comm.all_reduce_rms_norm(x, residual, weight, eps)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation along `dim` of every rank's x (same shape on every rank), rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.contiguous()
        # Gather into a leading rank dimension, then move it next to `dim`.
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        # gloo wants the output flat along dim 0: [world_size * x.shape[0], ...]. torch 2.13
        # renamed all_gather_into_tensor (now deprecated) to all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1, *x.shape[1:]), x, group=self.group)
        out = out.movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1 :])

    def barrier(self) -> None:
        if self.world_size > 1:
            # NCCL's barrier is told its GPU (torch warns when it has to guess); gloo takes none.
            if self.device.type == "cuda" and self.device.index is not None:
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)


_WORLD: Optional[GroupCoordinator] = None
_TP: Optional[GroupCoordinator] = None
# ---- expert parallelism (wt-ep) ----
_EP: Optional[GroupCoordinator] = None  # set only with enable_expert_parallel
_EXPERT_PLACEMENT = "linear"  # vLLM's expert_placement_strategy: "linear" | "round_robin"


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, local_rank: int, backend: str
) -> None:
    """Joins the world of workers (torch.distributed.init_process_group) once per process."""
    global _WORLD
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed backend must be gloo or nccl, got {backend!r}")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method=distributed_init_method, world_size=world_size,
            rank=rank,
        )
    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"torch.distributed already has a world of {dist.get_world_size()}, not {world_size}"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD, device)


def initialize_model_parallel(tensor_parallel_size: int, enable_expert_parallel: bool = False,
                              expert_placement_strategy: str = "linear") -> None:
    """Builds the tensor-parallel group over the whole world (no pipeline stages) and, with
    enable_expert_parallel, the expert-parallel group (the same ranks: EP = TP x DP, DP = 1)."""
    global _TP, _EP, _EXPERT_PLACEMENT
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() must run before "
                           "initialize_model_parallel()")
    if tensor_parallel_size != _WORLD.world_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} must equal the world size "
            f"{_WORLD.world_size} (pipeline parallelism is not offered)"
        )
    _TP = GroupCoordinator(list(_WORLD.ranks), _WORLD.rank_in_group, _WORLD.group,
                           _WORLD.device)
    _EXPERT_PLACEMENT = expert_placement_strategy
    _EP = _TP if enable_expert_parallel else None


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError("the tensor-parallel group is not initialized")
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group if _TP is not None else 0


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size if _TP is not None else 1


# ---- expert parallelism (wt-ep) ----
def get_ep_group() -> GroupCoordinator:
    if _EP is None:
        raise RuntimeError("the expert-parallel group is not initialized")
    return _EP


def get_expert_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in the expert-parallel group: (0, 1) without expert
    parallelism (the MoE layers then shard experts with tensor parallelism)."""
    return (_EP.rank_in_group, _EP.world_size) if _EP is not None else (0, 1)


def get_expert_placement_strategy() -> str:
    return _EXPERT_PLACEMENT


def destroy_model_parallel() -> None:
    """Drops the groups and leaves torch.distributed (a worker's last act)."""
    global _TP, _WORLD, _EP, _EXPERT_PLACEMENT
    if _TP is not None and _TP.device_communicator is not None:
        _TP.device_communicator.close()
    _TP = None
    _EP, _EXPERT_PLACEMENT = None, "linear"
    _WORLD = None
    if dist.is_initialized():
        _leave_world()


# Set in every worker process's environment unless the user set them. TORCH_NCCL_DUMP_ON_TIMEOUT:
# with it on (torch's default), each rank's NCCL heartbeat monitor polls rank 0's rendezvous
# TCPStore for a "should dump" flag until the process ends, and a rank still alive when rank 0's
# process has exited prints 'Failed to check the "should dump" flag on TCPStore' with a c10 stack
# (seen at the end of 4-GPU runs even with _leave_world's ordering). Off, no flight-recorder dump
# is written on an NCCL timeout; the watchdog still detects and reports the timeout.
WORKER_ENV_DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (a copy of this process's environment) with WORKER_ENV_DEFAULTS filled in where
    unset."""
    return {**WORKER_ENV_DEFAULTS, **env}


# How long rank 0 waits for the other ranks to leave (below the executor's 5 s shutdown grace, after
# which it kills the workers that are left).
_LEAVE_TIMEOUT_S = 3.0


def _leave_world() -> None:
    """destroy_process_group with rank 0 leaving last. Rank 0's process hosts the rendezvous
    TCPStore; a rank whose NCCL heartbeat monitor still polls that store after rank 0 has exited
    prints 'Failed to check the "should dump" flag on TCPStore' tracebacks (seen at the end of
    every 4-GPU run). Each other rank says through the store that its group is gone; rank 0
    waits for that, bounded, then leaves."""
    from datetime import timedelta

    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to coordinate through: just leave
        store = None
    dist.destroy_process_group()
    if store is None or world_size == 1:
        return
    try:
        if rank != 0:
            store.set(f"pyorch/left/{rank}", "1")
        else:
            store.wait([f"pyorch/left/{r}" for r in range(1, world_size)],
                       timedelta(seconds=_LEAVE_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - a rank that died first: nothing left to protect
        logger.debug("leaving the process group: %s", e)
