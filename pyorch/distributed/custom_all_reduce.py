"""pyorch's custom all-reduce for the GPUs of one host (vLLM's CustomAllreduce, our kernel).

Each rank allocates one buffer (`pyorch._C.custom_all_reduce_buffer_size(max_bytes)` bytes),
shares its CUDA IPC handle with the group (torch.distributed all_gather_object) and maps the
peers'. `all_reduce(x)` returns the sum in a new tensor, or None when the message is not for
this kernel (not CUDA, an unsupported dtype, not a multiple of 16 bytes, larger than
`max_bytes`), and the caller uses NCCL. The kernel copies the input into the IPC buffer itself,
so eager calls and CUDA-graph replays work with any input tensor (cuda/allreduce/).

`create(group)` returns None, with the reason in the log, where the kernel cannot run: a world
size other than 2, 4, 6 or 8, or GPUs without peer access to each other.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Largest message the kernel takes per world size, NCCL beyond. 2 ranks: measured with
# bench/cpp/bench_custom_all_reduce.cu on 2 H100s (bf16; bench/results/NVIDIA_H100_80GB_HBM3x2/):
# 1.08-1.25x NCCL up to 256 KiB, 0.98x at 512 KiB and mostly slower past it. 4/6/8 ranks: vLLM's
# published Hopper limits, not re-measured yet. Each rank holds two message buffers of this size.
MAX_BYTES_BY_WORLD_SIZE = {2: 256 << 10, 4: 32 << 20, 6: 512 << 10, 8: 256 << 10}
SUPPORTED_WORLD_SIZES = tuple(MAX_BYTES_BY_WORLD_SIZE)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALGO_AUTO, ALGO_ONE_SHOT, ALGO_TWO_SHOT = 0, 1, 2


class CustomAllreduce:
    def __init__(self, group: Any, rank: int, world_size: int, device: torch.device,
                 max_bytes: Optional[int] = None) -> None:
        from pyorch import _ops

        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes or MAX_BYTES_BY_WORLD_SIZE[world_size]
        self.device = device
        self.algo = ALGO_AUTO
        size = _c().custom_all_reduce_buffer_size(self.max_bytes)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        _ops.custom_all_reduce_init_buffer(self.buffer)
        torch.cuda.synchronize(device)
        handle = _c().ipc_handle_of(self.buffer.data_ptr())
        handles: list[Any] = [None] * world_size
        dist.all_gather_object(handles, handle, group=group)
        self._opened: list[int] = []
        pointers = []
        for r, h in enumerate(handles):
            if r == rank:
                pointers.append(self.buffer.data_ptr())
            else:
                ptr = _c().ipc_open(h)
                self._opened.append(ptr)
                pointers.append(ptr)
        self.pointers = pointers
        dist.barrier(group=group)  # every signal area is zeroed and mapped before the first use

    @classmethod
    def create(cls, group: Any) -> Optional["CustomAllreduce"]:
        """The communicator for a GroupCoordinator (pyorch.distributed.parallel_state), or None
        where the kernel cannot serve this group (NCCL then takes every all-reduce)."""
        world_size, rank = group.world_size, group.rank_in_group
        device = group.device
        if device.type != "cuda":
            return None
        if world_size not in SUPPORTED_WORLD_SIZES:
            logger.info("custom all-reduce off: world size %d (supported: %s)", world_size,
                        SUPPORTED_WORLD_SIZES)
            return None
        ordinals = [None] * world_size
        dist.all_gather_object(ordinals, device.index, group=group.group)
        peers_ok = all(o == device.index or torch.cuda.can_device_access_peer(device.index, o)
                       for o in ordinals)
        every_ok: list[Any] = [None] * world_size
        dist.all_gather_object(every_ok, peers_ok, group=group.group)
        if not all(every_ok):
            logger.info("custom all-reduce off: the GPUs %s lack peer access", ordinals)
            return None
        comm = cls(group.group, rank, world_size, device)
        logger.info("custom all-reduce on: %d ranks, messages up to %d bytes", world_size,
                    comm.max_bytes)
        return comm

    def should_custom_ar(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.device == self.device and x.dtype in _DTYPES
                and x.is_contiguous() and nbytes % 16 == 0 and 0 < nbytes <= self.max_bytes
                and x.data_ptr() % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum over the group in a new tensor, or None (use NCCL) for a message the kernel
        does not take."""
        if not self.should_custom_ar(x):
            return None
        from pyorch import _ops

        out = torch.empty_like(x)
        _ops.custom_all_reduce(out, x, self.pointers, self.rank, self.max_bytes, self.algo)
        return out

    def close(self) -> None:
        for ptr in self._opened:
            _c().ipc_close(ptr)
        self._opened = []


def _c() -> Any:
    import pyorch._C

    return pyorch._C
