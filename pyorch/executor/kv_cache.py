"""KV-cache sizing and allocation.

Per layer: key and value caches of shape [num_blocks, block_size, num_kv_heads, head_size] (NHD).
Block 0 is the scheduler's reserved null block, so usable blocks are num_blocks - 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The CPU budget when the user gives none (vLLM's CPU backend uses the same default, 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        # key + value, every layer
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem

    def allocate(self, num_blocks: int,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        # One allocation for all layers: [num_layers, 2, *shape]; each layer gets two views.
        storage = torch.empty((self.num_layers, 2, *shape), dtype=self.dtype, device=device)
        return [(storage[i, 0], storage[i, 1]) for i in range(self.num_layers)]


def num_blocks_from_bytes(spec: KVCacheSpec, budget_bytes: int, what: str) -> int:
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"{what} ({budget_bytes / 2**20:.1f} MiB) holds no KV block: one block needs "
            f"{spec.bytes_per_block / 2**20:.2f} MiB. Increase it or lower "
            "max_model_len/block_size."
        )
    return int(num_blocks)


def gpu_kv_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, peak_activation_bytes: int
) -> int:
    """What is left for the KV cache after weights, the profiled activation peak and non-torch
    memory (CUDA context, cuBLAS workspaces, other processes), within gpu_memory_utilization."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)  # weights and persistent buffers
    non_torch = (total - free) - reserved
    budget = int(total * gpu_memory_utilization) - non_torch - allocated - peak_activation_bytes
    logger.info(
        "GPU memory: total %.2f GiB, weights+buffers %.2f GiB, activation peak %.2f GiB, "
        "non-torch %.2f GiB, KV budget %.2f GiB",
        total / 2**30, allocated / 2**30, peak_activation_bytes / 2**30, non_torch / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"No GPU memory left for the KV cache at gpu_memory_utilization="
            f"{gpu_memory_utilization}: weights take {allocated / 2**30:.2f} GiB and the "
            f"profiled forward pass {peak_activation_bytes / 2**30:.2f} GiB of "
            f"{total / 2**30:.2f} GiB. Raise gpu_memory_utilization or lower "
            f"max_num_batched_tokens / max_num_seqs."
        )
    return budget
