"""The tensor-parallel collectives the layers call (vLLM's names), and the fused all-reduce +
residual add + RMSNorm of the decoder layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from pyorch.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    get_tp_group,
    model_parallel_is_initialized,
)

if TYPE_CHECKING:
    from pyorch.layers.layernorm import RMSNorm


def fuse_all_reduce_rms_norm() -> bool:
    """Whether decoder layers built now leave their row-parallel outputs (o_proj, down_proj)
    unreduced and reduce them inside the next RMSNorm (tensor_model_parallel_all_reduce_rms_norm):
    one kernel instead of the all-reduce and fused_add_rms_norm on CUDA. Under tensor
    parallelism unless PYORCH_FUSED_ALLREDUCE_RMS_NORM=0; read once when a layer is built."""
    from pyorch import envs

    return get_tensor_model_parallel_world_size() > 1 and bool(
        envs.PYORCH_FUSED_ALLREDUCE_RMS_NORM)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the tensor-parallel group; x itself without a group."""
    if not model_parallel_is_initialized():
        return x
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along dim, in rank order; x itself without a group."""
    if not model_parallel_is_initialized():
        return x
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_all_reduce_rms_norm(
    x: torch.Tensor,  # [T, hidden]: this rank's partial sum (a row-parallel output, unreduced)
    residual: torch.Tensor,  # [T, hidden], updated in place
    norm: "RMSNorm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + all-reduce(x)), the new residual), like norm(all-reduce(x), residual):
    one kernel where the custom all-reduce takes it, else the all-reduce then the norm (gloo on
    the CPU, NCCL past the kernel's range)."""
    if model_parallel_is_initialized():
        group = get_tp_group()
        out = group.all_reduce_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
        if out is not None:
            return out, residual
        x = group.all_reduce(x)
    return cast(tuple[torch.Tensor, torch.Tensor], norm(x, residual))
