"""The compressed-tensors schemes pyorch runs (vLLM's CompressedTensorsScheme family).

Checkpoint tensors of a W8A8 layer: `weight` (fp8 / int8 [N, K]), `weight_scale` ([N, 1] per
channel, [1] per tensor), and for static activations `input_scale` [1] (+ `input_zero_point`
[1] for asymmetric int8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from pyorch.layers.parameter import (
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from pyorch.layers.quantization.utils.w8a8_utils import (
    apply_fp8_linear,
    apply_int8_linear,
    per_tensor_to_channelwise,
    replace_parameter,
)

_UNSET = torch.finfo(torch.float32).min


class CompressedTensorsScheme(ABC):
    """Creates, loads and applies one layer's weights in one compressed-tensors scheme."""

    @abstractmethod
    def create_weights(self, layer: Any, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        ...

    @abstractmethod
    def process_weights_after_loading(self, layer: Any) -> None:
        ...

    @abstractmethod
    def apply_weights(self, layer: Any, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        ...


class _W8A8(CompressedTensorsScheme):
    """What the fp8 and int8 W8A8 schemes share: the parameters and their loading."""

    weight_dtype: torch.dtype

    def __init__(self, weights: Any, acts: Any):
        self.per_channel = str(weights.strategy) == "channel"
        self.static_input = not acts.dynamic
        self.per_token = str(acts.strategy) == "token"
        self.symmetric_input = bool(acts.symmetric)

    @classmethod
    def from_args(cls, weights: Any, acts: Any, fmt: str) -> CompressedTensorsScheme:
        return cls(weights, acts)

    def create_weights(self, layer: Any, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        n, shards = sum(output_partition_sizes), len(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            torch.empty(n, input_size_per_partition, dtype=self.weight_dtype), output_dim=0,
            input_dim=1, weight_loader=weight_loader))
        if self.per_channel:
            scale: nn.Parameter = ChannelQuantScaleParameter(
                torch.empty(n, 1, dtype=torch.float32), output_dim=0, weight_loader=weight_loader)
        else:
            scale = PerTensorScaleParameter(torch.full((shards,), _UNSET, dtype=torch.float32),
                                            weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        if self.static_input:
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                torch.full((shards,), _UNSET, dtype=torch.float32), weight_loader=weight_loader))
            if not self.symmetric_input:
                layer.register_parameter("input_zero_point", PerTensorScaleParameter(
                    torch.zeros(shards, dtype=torch.int32), weight_loader=weight_loader))

    def _check_loaded(self, layer: Any) -> None:
        for name in ("weight_scale", "input_scale"):
            p = getattr(layer, name, None)
            if isinstance(p, PerTensorScaleParameter) and bool((p.data == _UNSET).any()):
                raise ValueError(f"{getattr(layer, 'prefix', '')}: the checkpoint has no {name} "
                                 "for some shard")


class CompressedTensorsW8A8Fp8(_W8A8):
    """fp8 weights (per tensor or channel) x fp8 activations (static per tensor, dynamic per
    token or tensor) -> cutlass_scaled_mm. Merged per-tensor weight scales become per-channel
    (exact; vLLM requantizes them to their max); a static input scale is the max over the merged
    shards."""

    weight_dtype = torch.float8_e4m3fn

    def process_weights_after_loading(self, layer: Any) -> None:
        self._check_loaded(layer)
        weight = layer.weight.data
        if self.per_channel:
            scale = layer.weight_scale.data.reshape(-1).contiguous()
        else:
            scale = per_tensor_to_channelwise(layer.weight_scale.data,
                                              layer.output_partition_sizes)
        replace_parameter(layer, "weight", weight.t())
        replace_parameter(layer, "weight_scale", scale)
        if self.static_input:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))

    def apply_weights(self, layer: Any, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_input else None
        return apply_fp8_linear(x, layer.weight, layer.weight_scale, input_scale, bias,
                                per_token=self.per_token)


class CompressedTensorsW8A8Int8(_W8A8):
    """int8 weights (symmetric, per tensor or channel) x int8 activations (static per tensor or
    dynamic per token, symmetric or with a zero point) -> cutlass_scaled_mm(_azp). Merged
    per-tensor weight scales become per-channel (vLLM's convert_to_channelwise); merged static
    input ranges are joined into one scale and zero point."""

    weight_dtype = torch.int8

    def process_weights_after_loading(self, layer: Any) -> None:
        self._check_loaded(layer)
        weight = layer.weight.data
        if self.per_channel:
            scale = layer.weight_scale.data.reshape(-1).contiguous()
        else:
            scale = per_tensor_to_channelwise(layer.weight_scale.data,
                                              layer.output_partition_sizes)
        replace_parameter(layer, "weight", weight.t())
        replace_parameter(layer, "weight_scale", scale)
        azp = None
        if self.static_input:
            scales = layer.input_scale.data
            if self.symmetric_input:
                replace_parameter(layer, "input_scale", scales.max().reshape(1))
            else:
                zps = layer.input_zero_point.data.to(torch.float32)
                hi = (scales * (127 - zps)).max()
                lo = (scales * (-128 - zps)).min()
                scale = (hi - lo) / 255
                azp = torch.round(-128 - lo / scale).to(torch.int32)
                replace_parameter(layer, "input_scale", scale.reshape(1).to(torch.float32))
                replace_parameter(layer, "input_zero_point", azp.reshape(1))
        if not self.symmetric_input:
            colsum = weight.to(torch.int32).sum(dim=1, dtype=torch.int32)  # [N]
            adj = colsum * azp if azp is not None else colsum
            layer.register_buffer("azp_adj", adj.to(torch.int32).contiguous(), persistent=False)

    def apply_weights(self, layer: Any, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return apply_int8_linear(
            x, layer.weight, layer.weight_scale,
            layer.input_scale if self.static_input else None,
            getattr(layer, "input_zero_point", None) if self.static_input else None,
            getattr(layer, "azp_adj", None), bias, self.symmetric_input)
