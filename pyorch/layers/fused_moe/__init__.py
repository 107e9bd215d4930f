"""Mixture-of-experts layer and its functional form (vLLM's fused_moe package)."""

from pyorch.layers.fused_moe.fused_moe import (
    fused_experts,
    fused_topk,
    grouped_topk,
    moe_align_block_size,
)
from pyorch.layers.fused_moe.layer import FusedMoE

__all__ = ["FusedMoE", "fused_experts", "fused_topk", "grouped_topk", "moe_align_block_size"]
