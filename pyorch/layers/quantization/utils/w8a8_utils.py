"""W8A8 linear helpers shared by fp8 and compressed-tensors (vLLM's w8a8_utils / fp8_utils):
quantize the activations, run the scaled GEMM, turn merged per-tensor scales into per-channel ones.

Weights are stored transposed for the GEMM: `layer.weight` is the [K, N] column-major view
(weight.t()) of the [N, K] checkpoint tensor, which is what cutlass_scaled_mm takes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from pyorch import _ops

BLOCK_SIZE = 128
# Up to this many rows an fp8 linear (per-tensor or per-channel weight scales) runs
# skinny_gemm_fp8 (bf16/fp16 activations times the widened e4m3 weight, no activation quant
# kernel) instead of scaled_fp8_quant + cutlass_scaled_mm: on CUDA for speed (one weight stream,
# one kernel), on the CPU too, so that both devices compute a decode step the same way.
FP8_SKINNY_MAX_TOKENS = 16
_SKINNY_DTYPES = (torch.float16, torch.bfloat16)


def use_skinny_fp8(
    x: torch.Tensor,  # [num_tokens, K]
    weight_nk: torch.Tensor,  # [N, K] e4m3 (the transpose of the stored [K, N] view)
    weight_scale: torch.Tensor,  # [1] or [N]
    bias: torch.Tensor | None,
) -> bool:
    """Whether x @ weight^T goes to skinny_gemm_fp8: a product of few rows in the layouts its
    16-byte loads need (the decode path of the fp8 linear methods)."""
    return (
        0 < x.shape[0] <= FP8_SKINNY_MAX_TOKENS
        and x.dtype in _SKINNY_DTYPES
        and weight_nk.dtype == torch.float8_e4m3fn
        and weight_nk.is_contiguous()
        and weight_scale.dtype == torch.float32
        and weight_scale.numel() in (1, weight_nk.shape[0])
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and x.shape[1] > 0
        and x.shape[1] % 16 == 0
        and x.stride(1) == 1
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and x.data_ptr() % 16 == 0
        and weight_nk.data_ptr() % 16 == 0
    )


class Fp8Activation(NamedTuple):
    """An fp8 linear's input already quantized per token, the way its own dynamic per-token
    quantization would (rms_norm_dynamic_per_token_quant quantizes the norm's output in the norm's
    kernel, silu_and_mul_dynamic_per_token_quant the MLP's activation in its kernel):
    apply_fp8_linear runs the GEMM on it directly."""

    q: torch.Tensor  # [T, K] float8_e4m3fn
    scales: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the activations' dtype, the GEMM's output dtype


# Tests turn these off to compare the fused quantizations with the separate ones: the norms that
# quantize (rms_norm_fp8_input) and SiLU-and-mul that quantizes (silu_and_mul_fp8_input).
FUSED_NORM_QUANT = True
FUSED_ACT_QUANT = True


def _accepts_fp8_activation(linear: nn.Module | None) -> bool:
    """Whether `linear` would quantize a W8A8 input of more than FP8_SKINNY_MAX_TOKENS rows to fp8
    per token, dynamically (its quant method says so: accepts_fp8_activation)."""
    method = getattr(linear, "quant_method", None)
    accepts = getattr(method, "accepts_fp8_activation", None)
    return accepts is not None and bool(accepts(linear))


def takes_fp8_activation(linear: nn.Module | None) -> bool:
    """_accepts_fp8_activation, while the norms quantize (FUSED_NORM_QUANT)."""
    return FUSED_NORM_QUANT and _accepts_fp8_activation(linear)


def rms_norm_fp8_input(
    norm: Any,  # an RMSNorm
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden], updated in place (None: x is the residual)
    linear: nn.Module | None,  # the fp8 linear that takes the normed rows
) -> tuple[Fp8Activation, torch.Tensor] | None:
    """norm(x) (after residual += x) quantized per token to fp8 in one op, as `linear` would
    quantize it, with the residual stream; None where linear would not (a decode batch of at most
    FP8_SKINNY_MAX_TOKENS rows takes bf16 activations, or no dynamic per-token fp8 linear), and the
    caller runs the norm. The bits equal the norm and then linear's own quantization."""
    if x.dim() != 2 or x.shape[0] <= FP8_SKINNY_MAX_TOKENS or not takes_fp8_activation(linear):
        return None
    q, scales = _ops.rms_norm_dynamic_per_token_quant(
        x, norm.weight, norm.variance_epsilon, torch.float8_e4m3fn, residual=residual)
    return Fp8Activation(q, scales, x.dtype), x if residual is None else residual


def silu_and_mul_fp8_input(
    x: torch.Tensor,  # [T, 2 * d]: gate_up_proj's output, gate then up
    linear: nn.Module | None,  # the fp8 linear that takes silu(gate) * up (down_proj)
) -> Fp8Activation | None:
    """silu(gate) * up quantized per token to fp8 in one op, as `linear` would quantize it; None
    where linear would not (a decode batch of at most FP8_SKINNY_MAX_TOKENS rows takes bf16
    activations, or no dynamic per-token fp8 linear), and the caller runs silu_and_mul. The bits
    equal silu_and_mul and then linear's own quantization."""
    if (not FUSED_ACT_QUANT or x.dim() != 2 or x.shape[0] <= FP8_SKINNY_MAX_TOKENS
            or not _accepts_fp8_activation(linear)):
        return None
    q, scales = _ops.silu_and_mul_dynamic_per_token_quant(x, torch.float8_e4m3fn)
    return Fp8Activation(q, scales, x.dtype)


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
    x: torch.Tensor | Fp8Activation,  # [..., K]
    weight: torch.Tensor,  # [K, N] column-major fp8
    weight_scale: torch.Tensor,  # [1] or [N] float32
    input_scale: torch.Tensor | None,  # [1] static, None dynamic
    bias: torch.Tensor | None,  # [N]
    per_token: bool,
) -> torch.Tensor:  # [..., N] in x's dtype
    """Quantizes x to fp8 (static per-tensor, or dynamic per-token / per-tensor), then
    cutlass_scaled_mm with the weight's scales. A decode batch (use_skinny_fp8) runs
    skinny_gemm_fp8 instead: x unquantized (so input_scale and per_token do not apply) times the
    e4m3 weight widened exactly, summed in fp32, times weight_scale. An Fp8Activation (x quantized
    per token by the norm before) goes to cutlass_scaled_mm as it is."""
    if isinstance(x, Fp8Activation):
        if input_scale is not None or not per_token:
            raise ValueError("apply_fp8_linear: an Fp8Activation is quantized dynamically per "
                             "token; this layer quantizes its input with a static or per-tensor "
                             "scale")
        return _ops.cutlass_scaled_mm(x.q, weight, x.scales, weight_scale, x.dtype, bias)
    x2 = x.reshape(-1, x.shape[-1])
    weight_nk = weight.t()
    if use_skinny_fp8(x2, weight_nk, weight_scale, bias):
        out = torch.empty(x2.shape[0], weight_nk.shape[0], dtype=x.dtype, device=x.device)
        _ops.skinny_gemm_fp8(out, x2, weight_nk, weight_scale, bias)
        return out.view(*x.shape[:-1], weight_nk.shape[0])
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
