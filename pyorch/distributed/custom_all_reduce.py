"""pyorch's custom all-reduce for the GPUs of one host (vLLM's CustomAllreduce, our kernel).

Each rank allocates one buffer (`pyorch._C.custom_all_reduce_buffer_size(max_bytes)` bytes),
shares its CUDA IPC handle with the group (torch.distributed all_gather_object) and maps the
peers'. `all_reduce(x)` returns the sum in a new tensor, or None when the message is not for
this kernel (not CUDA, an unsupported dtype, not a multiple of 16 bytes, past the measured
range), and the caller uses NCCL. The kernel moves the input into the IPC buffers itself (the
push one-shot stores it straight into every peer's buffer), so eager calls and CUDA-graph
replays work with any input tensor and nothing is registered per tensor (cuda/allreduce/).
`all_reduce_rms_norm` is the fused all-reduce + residual add + RMSNorm of the decoder layers.

Which kernel takes a message of a given size is a table per world size (`ALGO_LIMITS`), read off
`bench_custom_all_reduce` runs by bench/all_reduce_cutoffs.py: the fastest of one-shot push,
one-shot pull and two-shot at each size, and NCCL past the last size where the fastest beats it.

`create(group)` returns None, with the reason in the log, where the kernel cannot run: a world
size other than 2, 4, 6 or 8, GPUs without peer access to each other, or (more than 2 ranks)
GPUs that are not all joined by NVLink.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ALGO_AUTO, ALGO_ONE_SHOT, ALGO_TWO_SHOT, ALGO_ONE_SHOT_PUSH = 0, 1, 2, 3
# Per world size: (up to this many bytes, the algorithm), by increasing size; NCCL past the last.
# 2 ranks: measured on 2 H100s (NVLink), CUDA-graph timings, bench/results/
# NVIDIA_H100_80GB_HBM3x2/all_reduce_graph.json; `python bench/all_reduce_cutoffs.py
# bench/results/NVIDIA_H100_80GB_HBM3x2/all_reduce_graph.json` prints this row.
# 4 ranks: measured on 4 H200s (NVLink), CUDA-graph timings, bench/results/NVIDIA_H200x4/
# all_reduce_4.json (push 1.9-2.5x NCCL up to 256 KiB, 1.5x at 512 KiB; two-shot 1.17-1.40x
# from 1 to 4 MiB; NCCL from 8 MiB); `python bench/all_reduce_cutoffs.py` on it prints this row.
# 6/8 ranks: UNMEASURED (no 8-GPU run yet): the push kernel up to its slot size.
ALGO_LIMITS: dict[int, list[tuple[int, int]]] = {
    2: [(512 << 10, ALGO_ONE_SHOT_PUSH), (8192 << 10, ALGO_ONE_SHOT)],
    4: [(512 << 10, ALGO_ONE_SHOT_PUSH), (4096 << 10, ALGO_TWO_SHOT)],
    6: [(512 << 10, ALGO_ONE_SHOT_PUSH)],
    8: [(256 << 10, ALGO_ONE_SHOT_PUSH)],
}
# Largest message the kernel takes per world size, NCCL beyond. Each rank holds two message
# buffers of this size plus the push slots (cuda/allreduce/custom_all_reduce.cuh).
# A world size whose table is empty (NCCL won at every size measured) gets no custom all-reduce.
MAX_BYTES_BY_WORLD_SIZE = {n: limits[-1][0] for n, limits in ALGO_LIMITS.items() if limits}
# Largest [rows, hidden] message the fused all-reduce + RMSNorm takes per world size (it is a
# one-shot push kernel; past this, all-reduce then fused_add_rms_norm).
FUSED_NORM_MAX_BYTES = {n: min(b, 256 << 10) for n, b in MAX_BYTES_BY_WORLD_SIZE.items()}
SUPPORTED_WORLD_SIZES = tuple(MAX_BYTES_BY_WORLD_SIZE)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSED_NORM_MAX_ROW_BYTES = 512 * 4 * 16  # kFusedNormMaxRowBytes (cuda/include/pyorch/)


class CustomAllreduce:
    def __init__(self, group: Any, rank: int, world_size: int, device: torch.device,
                 max_bytes: Optional[int] = None) -> None:
        from pyorch import _ops

        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes or MAX_BYTES_BY_WORLD_SIZE[world_size]
        self.device = device
        self.algo: Optional[int] = None  # None: ALGO_LIMITS; tests force one
        self.limits = [(min(b, self.max_bytes), a) for b, a in ALGO_LIMITS[world_size]]
        self.push_bytes = _c().custom_all_reduce_push_bytes(self.max_bytes)
        self.fused_norm_max_bytes = min(FUSED_NORM_MAX_BYTES[world_size], self.push_bytes)
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
        # Every signal area is zeroed and mapped before the first use (an NCCL group: its GPU
        # named, or torch warns that it guessed).
        index = torch.device(device).index
        dist.barrier(group=group,
                     device_ids=[index if index is not None else torch.cuda.current_device()])

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
        ordinals: list[Any] = [None] * world_size
        dist.all_gather_object(ordinals, device.index, group=group.group)
        peers_ok = all(o == device.index or torch.cuda.can_device_access_peer(device.index, o)
                       for o in ordinals)
        # More than 2 ranks over PCIe: the peers' loads and stores lose to NCCL's rings (vLLM's
        # rule). Each rank checks, and all must agree, or some would wait in the set-up below.
        nvlink_ok = world_size == 2 or fully_nvlinked([int(o) for o in ordinals])
        every_ok: list[Any] = [None] * world_size
        dist.all_gather_object(every_ok, (peers_ok, nvlink_ok), group=group.group)
        if not all(ok for ok, _ in every_ok):
            logger.info("custom all-reduce off: the GPUs %s lack peer access", ordinals)
            return None
        if not all(ok for _, ok in every_ok):
            logger.info("custom all-reduce off: the GPUs %s are not all joined by NVLink",
                        ordinals)
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

    def pick_algo(self, nbytes: int) -> Optional[int]:
        """The measured-fastest algorithm for a message of nbytes, None past the range."""
        for limit, algo in self.limits:
            if nbytes <= limit:
                return ALGO_ONE_SHOT if (algo == ALGO_ONE_SHOT_PUSH
                                         and nbytes > self.push_bytes) else algo
        return None

    def all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum over the group in a new tensor, or None (use NCCL) for a message the kernel
        does not take."""
        if not self.should_custom_ar(x):
            return None
        algo = self.algo if self.algo is not None else self.pick_algo(x.numel() * x.element_size())
        if algo is None:
            return None
        from pyorch import _ops

        out = torch.empty_like(x)
        _ops.custom_all_reduce(out, x, self.pointers, self.rank, self.max_bytes, algo)
        return out

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> Optional[torch.Tensor]:
        """residual += the sum of x over the group (in place), and RMSNorm(residual) * weight in
        a new tensor, as one kernel; None (nothing done) for shapes the kernel does not take."""
        nbytes = x.numel() * x.element_size()
        if not (x.is_cuda and x.device == self.device and x.dim() == 2 and x.dtype in _DTYPES
                and residual.shape == x.shape and residual.dtype == x.dtype
                and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
                and residual.device == x.device and weight.device == x.device
                and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
                and (x.shape[1] * x.element_size()) % 16 == 0
                and x.shape[1] * x.element_size() <= _FUSED_NORM_MAX_ROW_BYTES
                and 0 < nbytes <= self.fused_norm_max_bytes
                and all(t.data_ptr() % 16 == 0 for t in (x, residual, weight))):
            return None
        from pyorch import _ops

        out = torch.empty_like(x)
        _ops.custom_all_reduce_rms_norm(out, x, residual, weight, eps, self.pointers, self.rank,
                                        self.max_bytes)
        return out

    def close(self) -> None:
        for ptr in self._opened:
            _c().ipc_close(ptr)
        self._opened = []


def fully_nvlinked(ordinals: list[int]) -> bool:
    """Whether every pair of these CUDA devices is joined by NVLink (NVML's P2P status, found by
    the device UUID so CUDA_VISIBLE_DEVICES and the device order do not matter). False where NVML
    cannot tell."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    if nvml.nvmlInit_v2() != 0:
        return False
    try:
        handles = []
        for o in ordinals:
            uuid = str(torch.cuda.get_device_properties(o).uuid)
            key = (uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}").encode()
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByUUID(key, ctypes.byref(handle)) != 0:
                return False
            handles.append(handle)
        nvlink_index = 2  # NVML_P2P_CAPS_INDEX_NVLINK
        for i, a in enumerate(handles):
            for b in handles[i + 1:]:
                status = ctypes.c_int(-1)
                if (nvml.nvmlDeviceGetP2PStatus(a, b, nvlink_index, ctypes.byref(status)) != 0
                        or status.value != 0):  # NVML_P2P_STATUS_OK
                    return False
        return True
    finally:
        nvml.nvmlShutdown()


def _c() -> Any:
    import pyorch._C

    return pyorch._C
