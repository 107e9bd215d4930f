"""AWQ checkpoints (`quantization_config.quant_method == "awq"`), 4-bit with zero points, served
by pyorch's W4A16 kernel on the CPU and the GPU (vLLM's `awq` / `awq_marlin`: both names are
accepted and run the same kernel).

Checkpoint tensors per linear layer [N = out, K = in] (AutoAWQ, version "gemm"): qweight
[K, N / 8] int32 and qzeros [G, N / 8] int32, both packed along N in AutoAWQ's column order
[0, 2, 4, 6, 1, 3, 5, 7]; scales [G, N] float16; w = (q - z) * s. Supported: bits = 4,
zero_point = true, version "gemm", group_size 32/64/128/-1, `modules_to_not_convert` (those
layers stay unquantized). Refused with a clear error: other bit widths, zero_point = false and
the "gemv" / "exllama" / "ipex" layouts.
"""

from typing import Any, cast

import torch
from torch import nn

from pyorch import _ops
from pyorch.layers.linear import LinearBase, LinearMethodBase
from pyorch.layers.parameter import GroupQuantScaleParameter, PackedvLLMParameter
from pyorch.layers.quantization import (
    QuantizationConfig,
    is_layer_skipped,
    register_quantization_config,
)
from pyorch.layers.quantization.w4a16_linear import (
    act_dtype,
    apply_w4a16,
    check_w4a16_shape,
    pack_cols,
    replace_parameters,
    set_w4a16_weights,
    unpack_cols,
)
from pyorch.scalar_type import scalar_types

# AutoAWQ's interleave: column 8 c + j of a packed word sits in nibble AWQ_NIBBLE_OF_COLUMN[j]
# (the inverse of its pack order [0, 2, 4, 6, 1, 3, 5, 7]).
AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]


@register_quantization_config("awq")
class AWQConfig(QuantizationConfig):
    """AWQ 4-bit weights with zero points (see the module docstring for what is supported)."""

    def __init__(self, weight_bits: int, group_size: int, zero_point: bool,
                 modules_to_not_convert: list[str] | None = None, version: str = "gemm") -> None:
        name = self.get_name()
        if weight_bits != 4:
            raise ValueError(f"{name}: only 4-bit AWQ is supported, this checkpoint has "
                             f"w_bit={weight_bits}")
        if not zero_point:
            raise ValueError(f"{name}: only AWQ with zero points (zero_point=true) is supported")
        if version.lower() != "gemm":
            raise ValueError(f"{name}: AWQ version {version!r} is not supported (gemm)")
        if group_size not in (-1, 32, 64, 128):
            raise ValueError(f"{name}: group_size {group_size} is not supported "
                             "(32, 64, 128 or -1)")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.quant_type = scalar_types.uint4

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(weight_bits={self.weight_bits}, group_size="
                f"{self.group_size}, zero_point={self.zero_point}, modules_to_not_convert="
                f"{self.modules_to_not_convert})")

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]  # float32: the CPU kernel

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        return cls(
            weight_bits=cls.get_from_keys(config, ["w_bit", "bits"]),
            group_size=cls.get_from_keys(config, ["q_group_size", "group_size"]),
            zero_point=bool(cls.get_from_keys_or(config, ["zero_point"], True)),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"],
                                                        None),
            version=str(cls.get_from_keys_or(config, ["version"], "gemm")),
        )

    def is_layer_skipped(self, prefix: str) -> bool:
        # vLLM's AWQ matching: a listed name anywhere in the module's name.
        return is_layer_skipped(prefix, self.modules_to_not_convert, self.packed_modules_mapping,
                                lambda name, entry: entry in name)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> "AWQLinearMethod | None":
        if isinstance(layer, LinearBase) and not self.is_layer_skipped(prefix):
            return AWQLinearMethod(self)
        return None


@register_quantization_config("awq_marlin")
class AWQMarlinConfig(AWQConfig):
    """vLLM's name for AWQ on its Marlin kernel; in pyorch the same method as `awq`."""

    @classmethod
    def get_name(cls) -> str:
        return "awq_marlin"

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        if str(hf_quant_cfg.get("quant_method", "")).lower() == "awq" and (
                user_quant == "awq_marlin"):
            return "awq_marlin"
        return None


class AWQLinearMethod(LinearMethodBase):
    """Creates AWQ's checkpoint parameters and repacks them for pyorch's W4A16 kernel."""

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], input_size: int, output_size: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        cfg = self.config
        name = f"{cfg.get_name()} ({getattr(layer, 'prefix', '') or type(layer).__name__})"
        check_w4a16_shape(name, input_size_per_partition, output_partition_sizes,
                          cfg.group_size)
        row_split = input_size_per_partition != input_size
        if cfg.group_size == -1 and row_split:
            raise NotImplementedError(
                f"{name}: per-channel AWQ (group_size=-1) on a row-parallel layer split over "
                "tensor-parallel ranks is not supported")
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        num_groups = 1 if cfg.group_size == -1 else k // cfg.group_size
        loader = extra_weight_attrs["weight_loader"]
        layer.register_parameter("qweight", PackedvLLMParameter(
            torch.empty(k, n // 8, dtype=torch.int32), output_dim=1, input_dim=0, packed_dim=1,
            packed_factor=8, weight_loader=loader))
        layer.register_parameter("qzeros", PackedvLLMParameter(
            torch.empty(num_groups, n // 8, dtype=torch.int32), output_dim=1, input_dim=0,
            packed_dim=1, packed_factor=8, weight_loader=loader))
        layer.register_parameter("scales", GroupQuantScaleParameter(
            torch.empty(num_groups, n, dtype=params_dtype), output_dim=1, input_dim=0,
            weight_loader=loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = cast(torch.Tensor, layer.qweight).data
        k, n = qweight.shape[0], qweight.shape[1] * 8
        repacked = _ops.awq_marlin_repack(qweight.contiguous(), k, n, 4)
        zeros = pack_cols(unpack_cols(cast(torch.Tensor, layer.qzeros).data,
                                      AWQ_NIBBLE_OF_COLUMN))
        set_w4a16_weights(layer, repacked, cast(torch.Tensor, layer.scales).data, zeros, None,
                          self.config.quant_type, act_dtype(layer))
        replace_parameters(layer, ["qweight", "qzeros", "scales"])

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_w4a16(layer, x, bias)
