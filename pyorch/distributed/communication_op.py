"""The tensor-parallel collectives the layers call (vLLM's names)."""

from __future__ import annotations

import torch

from pyorch.distributed.parallel_state import get_tp_group, model_parallel_is_initialized


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
