"""Tensor parallelism: process groups, collectives and the shared-memory broadcast queue."""

from pyorch.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pyorch.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)

__all__ = [
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
