"""What the 4-bit weight-only methods (GPTQ, AWQ, compressed-tensors pack-quantized W4A16) share:
the shape checks of pyorch's W4A16 kernel, the conversions done once after loading, and the
forward through `gptq_marlin_gemm` (pyorch/_ops.py; CPU and CUDA).

After `process_weights_after_loading` a layer holds, whatever the checkpoint format:
  w4_qweight   [N / 16, K * 2] int32   the codes in pyorch's tile layout
  w4_scales    [G, N] params_dtype     group scales (G = K / group_size; 1 for per-channel)
  w4_zeros     [G, N / 8] int32 | None zero points, plain nibble order (uint4 only)
  w4_perm      [K] int32 | None        act-order: a's columns are permuted first
  w4_workspace int32 zeros             the k-split's counters
and `layer.w4_type` (scalar_types.uint4b8 or uint4).
"""

from typing import cast

import torch
from torch import nn

from pyorch import _ops
from pyorch.scalar_type import ScalarType

# pyorch's W4A16 kernel needs K (input features per rank) a multiple of this and N (output
# features per rank) a multiple of W4A16_N_MULTIPLE (cuda/include/pyorch/w4a16_layout.h).
W4A16_K_MULTIPLE = 64
W4A16_N_MULTIPLE = 16
W4A16_GROUP_SIZES = (-1, 32, 64, 128)


def check_w4a16_shape(method: str, input_size_per_partition: int,
                      output_partition_sizes: list[int], group_size: int) -> None:
    """Raises a clear ValueError when pyorch's W4A16 kernel cannot serve this layer."""
    if group_size not in W4A16_GROUP_SIZES:
        raise ValueError(f"{method}: group_size {group_size} is not supported (pyorch's 4-bit "
                         f"kernel takes {', '.join(map(str, W4A16_GROUP_SIZES))})")
    if input_size_per_partition % W4A16_K_MULTIPLE:
        raise ValueError(f"{method}: input features per rank ({input_size_per_partition}) must "
                         f"be a multiple of {W4A16_K_MULTIPLE} for pyorch's 4-bit kernel")
    if group_size != -1 and input_size_per_partition % group_size:
        raise ValueError(f"{method}: input features per rank ({input_size_per_partition}) are "
                         f"not a multiple of group_size {group_size}")
    for size in output_partition_sizes:
        if size % W4A16_N_MULTIPLE:
            raise ValueError(f"{method}: output features per rank ({size}) must be a multiple "
                             f"of {W4A16_N_MULTIPLE} for pyorch's 4-bit kernel")


def unpack_cols(packed: torch.Tensor, nibble_of_column: list[int]) -> torch.Tensor:
    """[R, C] int32 packed along columns -> [R, C * 8] int32 codes: column 8 c + j is nibble
    nibble_of_column[j] of word c."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    cols = [(words >> (4 * nibble_of_column[j])) & 0xF for j in range(8)]
    return torch.stack(cols, -1).reshape(packed.shape[0], -1).to(torch.int32)


def pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """[R, C * 8] codes (0..15) -> [R, C] int32, column 8 c + j in bits 4 j (the kernel's zero
    point layout)."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    words = torch.zeros(c.shape[:2], dtype=torch.int64, device=codes.device)
    for j in range(8):
        words |= c[..., j] << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def set_w4a16_weights(
    layer: nn.Module,
    qweight: torch.Tensor,  # [N / 16, K * 2] int32, repacked
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N / 8] int32, plain order
    perm: torch.Tensor | None,  # [K] int32
    quant_type: ScalarType,
    params_dtype: torch.dtype,
) -> None:
    """Stores the kernel's tensors on the layer (see the module docstring)."""
    n = scales.shape[1]
    # (type: ignore: nn.Module's attribute typing knows only tensors and modules)
    layer.w4_qweight = nn.Parameter(qweight, requires_grad=False)
    layer.w4_scales = nn.Parameter(scales.to(params_dtype).contiguous(), requires_grad=False)
    w4_zeros = nn.Parameter(zeros.contiguous(), requires_grad=False) if zeros is not None else None
    w4_perm = (nn.Parameter(perm.to(torch.int32).contiguous(), requires_grad=False)
               if perm is not None else None)
    layer.w4_zeros = w4_zeros  # type: ignore[assignment]
    layer.w4_perm = w4_perm  # type: ignore[assignment]
    layer.register_buffer("w4_workspace", _ops.w4a16_make_workspace(n, qweight.device),
                          persistent=False)
    layer.w4_type = quant_type  # type: ignore[assignment]
    layer.w4_size_n = n  # type: ignore[assignment]
    layer.w4_size_k = qweight.shape[1] // 2  # type: ignore[assignment]


def apply_w4a16(
    layer: nn.Module,
    x: torch.Tensor,  # [..., K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [..., N]
    n, k = cast(int, layer.w4_size_n), cast(int, layer.w4_size_k)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # the CUDA kernel's 16-byte loads
    scales = cast(torch.Tensor, layer.w4_scales)
    if x2.dtype != scales.dtype:
        raise TypeError(f"{type(layer).__name__}: 4-bit layer built for {scales.dtype} "
                        f"activations got {x2.dtype}")
    out = _ops.gptq_marlin_gemm(
        x2, None, cast(torch.Tensor, layer.w4_qweight), scales,
        cast(torch.Tensor | None, layer.w4_zeros), cast(torch.Tensor | None, layer.w4_perm),
        cast(torch.Tensor, layer.w4_workspace), cast(ScalarType, layer.w4_type), x2.shape[0],
        n, k,
    )
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], n)


def act_dtype(layer: nn.Module) -> torch.dtype:
    """The activations' dtype: the layer's params_dtype (the model's dtype)."""
    return cast(torch.dtype, getattr(layer, "params_dtype", torch.get_default_dtype()))


def replace_parameters(layer: nn.Module, names: list[str]) -> None:
    """Drops the checkpoint-format parameters once the kernel's copies exist."""
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)
