"""W8A8 linear helpers shared by fp8 and compressed-tensors (vLLM's w8a8_utils / fp8_utils):
quantize the activations, run the scaled GEMM, turn merged per-tensor scales into per-channel ones.

Weights are stored transposed for the GEMM: `layer.weight` is the [K, N] column-major view
(weight.t()) of the [N, K] checkpoint tensor, which is what cutlass_scaled_mm takes.
"""

from __future__ import annotations

import torch
from torch import nn

from pyorch import _ops

BLOCK_SIZE = 128


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swaps a loaded parameter for a plain Parameter holding `value` (its loader is no longer
    needed once the weights are processed)."""
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def per_tensor_to_channelwise(
    scales: torch.Tensor,  # [num_shards] float32: one per merged shard
    shard_sizes: list[int],  # rows of each shard
) -> torch.Tensor:  # [N]
    """The per-channel scales equal to a merged layer's per-shard (per-tensor) scales, so that
    one GEMM with per-channel weight scales computes every shard exactly (vLLM's
    convert_to_channelwise; for fp8, vLLM requantizes the shards to their max scale instead,
    which rounds the weights a second time)."""
    sizes = torch.tensor(shard_sizes, device=scales.device)
    if bool((scales == scales[0]).all()):
        return scales[:1].clone()
    return scales.repeat_interleave(sizes).contiguous()


def apply_fp8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [K, N] column-major fp8
    weight_scale: torch.Tensor,  # [1] or [N] float32
    input_scale: torch.Tensor | None,  # [1] static, None dynamic
    bias: torch.Tensor | None,  # [N]
    per_token: bool,
) -> torch.Tensor:  # [..., N] in x's dtype
    """Quantizes x to fp8 (static per-tensor, or dynamic per-token / per-tensor), then
    cutlass_scaled_mm with the weight's scales."""
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is not None:
        xq, xs = _ops.scaled_fp8_quant(x2, input_scale)
    else:
        xq, xs = _ops.scaled_fp8_quant(x2, use_per_token_if_dynamic=per_token)
    out = _ops.cutlass_scaled_mm(xq, weight, xs, weight_scale, x.dtype, bias)
    return out.view(*x.shape[:-1], weight.shape[1])


def apply_fp8_block_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] float32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [..., N]
    """The block-fp8 linear: activations in 1 x 128 groups (per_token_group_quant_fp8, scales
    column-major), weights in 128 x 128 blocks, one block-scaled GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = _ops.per_token_group_quant_fp8(x2, BLOCK_SIZE, column_major_scales=True)
    out = _ops.cutlass_scaled_mm(xq, weight.t(), xs, weight_scale.t(), x.dtype, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def apply_int8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [K, N] column-major int8
    weight_scale: torch.Tensor,  # [1] or [N]
    input_scale: torch.Tensor | None,  # [1] static, None dynamic per token
    input_zero_point: torch.Tensor | None,  # [1] int32 static azp
    azp_adj: torch.Tensor | None,  # [N] int32: colsum(weight) (times the static azp)
    bias: torch.Tensor | None,
    symmetric: bool,
) -> torch.Tensor:  # [..., N]
    """Quantizes x to int8 (static or dynamic per token, symmetric or with a zero point), then
    cutlass_scaled_mm (or its azp variant for asymmetric activations)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs, azp = _ops.scaled_int8_quant(x2, input_scale, input_zero_point, symmetric)
    if symmetric:
        out = _ops.cutlass_scaled_mm(xq, weight, xs, weight_scale, x.dtype, bias)
    else:
        assert azp_adj is not None
        # A static azp is folded into azp_adj; a dynamic one is per token.
        per_token_azp = None if input_scale is not None else azp
        out = _ops.cutlass_scaled_mm_azp(xq, weight, xs, weight_scale, x.dtype, azp_adj,
                                         per_token_azp, bias)
    return out.view(*x.shape[:-1], weight.shape[1])
