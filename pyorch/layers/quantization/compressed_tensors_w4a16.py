"""The compressed-tensors `pack-quantized` W4A16 scheme (vLLM's CompressedTensorsWNA16, 4-bit)
on pyorch's W4A16 kernel; it registers itself in compressed_tensors.py's scheme table.

Checkpoint tensors per linear layer [N = out, K = in] (what compressed-tensors' PackedQuantization
compressor writes): weight_packed [N, K / 8] int32 (8 codes per word along K, code = q + 8 for
q in [-8, 7]), weight_scale [N, K / group_size] (or [N, 1] per channel), weight_shape [2],
weight_zero_point [N / 8, G] int32 (asymmetric only: z + 8, packed along N) and weight_g_idx
[K] int32 (activation ordering). w = (q - z) * s. GPTQ's layout is the same codes transposed,
so the layer repacks with gptq_marlin_repack. Supported: 4-bit int weights, symmetric or not,
group 32/64/128 or per channel, actorder "group" / "weight" (equal groups, as on GPTQ), no
activation quantization. Others are refused at load by the scheme table (no entry matches).
"""

from typing import Any, cast

import torch
from torch import nn

from pyorch import _ops
from pyorch.layers.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)
from pyorch.layers.quantization.compressed_tensors import register_scheme
from pyorch.layers.quantization.compressed_tensors_schemes import CompressedTensorsScheme
from pyorch.layers.quantization.w4a16_linear import (
    act_dtype,
    apply_w4a16,
    check_w4a16_shape,
    replace_parameters,
    set_w4a16_weights,
)
from pyorch.scalar_type import scalar_types

NAME = "compressed-tensors W4A16"


class CompressedTensorsW4A16(CompressedTensorsScheme):
    """4-bit weights, 16-bit activations, pack-quantized."""

    def __init__(self, weights: Any):
        self.strategy = str(getattr(weights.strategy, "value", weights.strategy))
        self.group_size = -1 if self.strategy == "channel" else int(weights.group_size)
        self.symmetric = bool(weights.symmetric)
        actorder = getattr(weights, "actorder", None)
        self.actorder = str(getattr(actorder, "value", actorder)) if actorder else None
        self.quant_type = scalar_types.uint4b8 if self.symmetric else scalar_types.uint4

    @classmethod
    def from_args(cls, weights: Any, acts: Any, fmt: str) -> "CompressedTensorsW4A16":
        return cls(weights)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        name = f"{NAME} ({getattr(layer, 'prefix', '') or type(layer).__name__})"
        check_w4a16_shape(name, input_size_per_partition, output_partition_sizes,
                          self.group_size)
        row_split = input_size_per_partition != getattr(layer, "input_size",
                                                        input_size_per_partition)
        if row_split and (self.actorder or self.group_size == -1):
            raise NotImplementedError(
                f"{name}: {'activation ordering' if self.actorder else 'per-channel scales'} "
                "on a row-parallel layer split over tensor-parallel ranks is not supported")
        n, k = sum(output_partition_sizes), input_size_per_partition
        num_groups = 1 if self.group_size == -1 else k // self.group_size
        params: dict[str, BasevLLMParameter] = {
            "weight_packed": PackedvLLMParameter(
                torch.empty(n, k // 8, dtype=torch.int32), output_dim=0, input_dim=1,
                packed_dim=1, packed_factor=8, weight_loader=weight_loader),
            "weight_shape": BasevLLMParameter(torch.empty(2, dtype=torch.int64),
                                              weight_loader=weight_loader),
        }
        if self.group_size == -1:
            params["weight_scale"] = ChannelQuantScaleParameter(
                torch.empty(n, 1, dtype=params_dtype), output_dim=0, weight_loader=weight_loader)
        else:
            params["weight_scale"] = GroupQuantScaleParameter(
                torch.empty(n, num_groups, dtype=params_dtype), output_dim=0, input_dim=1,
                weight_loader=weight_loader)
        if not self.symmetric:
            params["weight_zero_point"] = PackedvLLMParameter(
                torch.empty(n // 8, num_groups, dtype=torch.int32), output_dim=0, input_dim=1,
                packed_dim=0, packed_factor=8, weight_loader=weight_loader)
        if self.actorder:
            params["weight_g_idx"] = RowvLLMParameter(
                torch.empty(k, dtype=torch.int32), input_dim=0, weight_loader=weight_loader)
        for pname, param in params.items():
            layer.register_parameter(pname, param)
        group_size = k if self.group_size == -1 else self.group_size
        row_offset = cast(int, getattr(layer, "tp_rank", 0)) * k if row_split else 0
        layer.ct_group_size = group_size  # type: ignore[assignment]
        layer.ct_row_offset = row_offset  # type: ignore[assignment]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = cast(torch.Tensor, layer.weight_packed).data  # [N, K / 8]
        n, k = packed.shape[0], packed.shape[1] * 8
        shape = cast(torch.Tensor, layer.weight_shape).data.tolist()
        if int(shape[1]) != int(getattr(layer, "input_size", k)):
            raise ValueError(f"{NAME}: {getattr(layer, 'prefix', '')} weight_shape {shape} does "
                             f"not match the layer's {getattr(layer, 'input_size', k)} inputs")
        group_size = cast(int, layer.ct_group_size)
        perm = None
        if self.actorder:
            g_idx = cast(torch.Tensor, layer.weight_g_idx).data.to(torch.int64)
            perm = torch.argsort(g_idx, stable=True)
            expected = (torch.arange(k, device=g_idx.device)
                        + cast(int, layer.ct_row_offset)) // group_size
            if not torch.equal(g_idx[perm], expected):
                raise ValueError(f"{NAME}: {getattr(layer, 'prefix', '')} weight_g_idx does not "
                                 f"put group_size={group_size} rows in each group: pyorch's "
                                 "kernel needs equal groups")
        perm32 = perm.to(torch.int32) if perm is not None else None
        # compressed-tensors packs along K per output row: GPTQ's qweight transposed.
        qweight = _ops.gptq_marlin_repack(packed.t().contiguous(), perm32, k, n, 4)
        scales = cast(torch.Tensor, layer.weight_scale).data.t()  # [G, N]
        zeros = None
        if not self.symmetric:  # [N / 8, G] packed along N -> [G, N / 8], plain order
            zeros = cast(torch.Tensor, layer.weight_zero_point).data.t().contiguous()
        set_w4a16_weights(layer, qweight, scales, zeros, perm32, self.quant_type,
                          act_dtype(layer))
        replace_parameters(layer, ["weight_packed", "weight_shape", "weight_scale",
                                   "weight_zero_point", "weight_g_idx"])

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return apply_w4a16(layer, x, bias)


def _matches(weights: Any, acts: Any, fmt: str) -> bool:
    if weights is None or acts is not None or fmt != "pack-quantized":
        return False
    strategy = str(getattr(weights.strategy, "value", weights.strategy))
    kind = str(getattr(weights.type, "value", weights.type))
    group_ok = strategy == "channel" or (strategy == "group" and weights.group_size in (32, 64,
                                                                                        128))
    return weights.num_bits == 4 and kind == "int" and group_ok and not weights.dynamic


register_scheme("W4A16 (pack-quantized)", _matches, CompressedTensorsW4A16.from_args)
