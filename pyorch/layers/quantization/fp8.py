"""fp8 W8A8 (`quantization="fp8"`, checkpoints with `quant_method: fp8`), as vLLM 0.26 does it.

- Online (a float checkpoint with quantization="fp8"): the weights load in the model dtype, then
  each linear weight is quantized to float8_e4m3fn with one dynamic per-tensor scale
  (absmax / 448; merged qkv / gate_up share one). Activations are quantized dynamically per
  token (vLLM's choice where the CUTLASS fp8 GEMM exists; pyorch has it on CPU and CUDA).
- fp8 checkpoints (`activation_scheme` "dynamic" or "static"): fp8 weights with a per-tensor
  `weight_scale` per checkpoint tensor (merged shards keep theirs, as per-channel scales:
  exact, where vLLM requantizes them to their max),
  and for "static" an `input_scale` (the max over merged shards) used for per-tensor activation
  quantization; "dynamic" quantizes activations per token.
- Block fp8 (`weight_block_size` [128, 128], DeepSeek-V3 / Qwen3-FP8): fp8 weights with a
  `weight_scale_inv` per 128 x 128 block; activations quantized per token in groups of 128
  (per_token_group_quant_fp8); dynamic activations only.
- `ignored_layers` (checkpoint names; a merged layer is skipped when all its shards are) stay in
  the model dtype. Mixture-of-experts layers are refused (pyorch/models/moe.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pyorch import _ops
from pyorch.layers.linear import LinearBase, LinearMethodBase
from pyorch.layers.parameter import (
    BlockQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from pyorch.layers.quantization import (
    QuantizationConfig,
    QuantizeMethodBase,
    is_layer_skipped,
    register_quantization_config,
)
from pyorch.layers.quantization.utils.w8a8_utils import (
    apply_fp8_block_linear,
    apply_fp8_linear,
    per_tensor_to_channelwise,
    replace_parameter,
)

ACTIVATION_SCHEMES = ("static", "dynamic")


@register_quantization_config("fp8")
class Fp8Config(QuantizationConfig):
    """fp8 e4m3 weights and activations; see the module docstring."""

    def __init__(
        self,
        is_checkpoint_fp8_serialized: bool = False,
        activation_scheme: str = "dynamic",
        ignored_layers: list[str] | None = None,
        weight_block_size: list[int] | None = None,
    ):
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8: unsupported activation_scheme {activation_scheme!r}; "
                             f"supported: {', '.join(ACTIVATION_SCHEMES)}")
        if weight_block_size is not None:
            if not is_checkpoint_fp8_serialized:
                raise ValueError("fp8: weight_block_size needs an fp8 checkpoint (online "
                                 "quantization is per tensor)")
            if list(weight_block_size) != [128, 128]:
                raise ValueError(f"fp8: weight_block_size {weight_block_size} is not supported; "
                                 "pyorch's block GEMM takes [128, 128]")
            if activation_scheme != "dynamic":
                raise ValueError("fp8: block-wise checkpoints need activation_scheme 'dynamic', "
                                 f"got {activation_scheme!r}")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])
        self.weight_block_size = list(weight_block_size) if weight_block_size else None

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 89  # fp8 tensor cores (Ada, Hopper)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        method = str(cls.get_from_keys_or(config, ["quant_method"], "fp8"))
        return cls(
            is_checkpoint_fp8_serialized="fp8" in method,
            activation_scheme=cls.get_from_keys_or(config, ["activation_scheme"], "dynamic"),
            ignored_layers=cls.get_from_keys_or(
                config, ["ignored_layers", "modules_to_not_convert"], None),
            weight_block_size=cls.get_from_keys_or(config, ["weight_block_size"], None),
        )

    def is_layer_skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping,
                                lambda name, entry: name == entry or name.startswith(entry + "."))

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return None if self.is_layer_skipped(prefix) else Fp8LinearMethod(self)
        return None


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, quant_config: Fp8Config):
        self.quant_config = quant_config
        self.block = quant_config.weight_block_size is not None
        self.static_input = quant_config.activation_scheme == "static"

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        loader = extra_weight_attrs["weight_loader"]
        layer.output_partition_sizes = output_partition_sizes
        n = sum(output_partition_sizes)
        serialized = self.quant_config.is_checkpoint_fp8_serialized
        weight_dtype = torch.float8_e4m3fn if serialized else params_dtype
        layer.register_parameter("weight", ModelWeightParameter(
            torch.empty(n, input_size_per_partition, dtype=weight_dtype), output_dim=0,
            input_dim=1, weight_loader=loader))
        if not serialized:
            return
        if self.block:
            self._check_block_shapes(layer, input_size_per_partition, output_partition_sizes,
                                     input_size)
            scale = torch.empty(-(-n // 128), -(-input_size_per_partition // 128),
                                dtype=torch.float32)
            layer.register_parameter("weight_scale_inv", BlockQuantScaleParameter(
                scale, output_dim=0, input_dim=1, block_size=(128, 128), weight_loader=loader))
            return
        shards = len(output_partition_sizes)
        layer.register_parameter("weight_scale", PerTensorScaleParameter(
            torch.full((shards,), torch.finfo(torch.float32).min), weight_loader=loader))
        if self.static_input:
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                torch.full((shards,), torch.finfo(torch.float32).min), weight_loader=loader))

    @staticmethod
    def _check_block_shapes(layer: Any, input_size_per_partition: int,
                            output_partition_sizes: list[int], input_size: int) -> None:
        """Merged shards and tensor-parallel slices must fall on 128-row/column blocks."""
        tp_size = getattr(layer, "tp_size", 1)
        prefix = getattr(layer, "prefix", "")
        if len(output_partition_sizes) > 1 or tp_size > 1:
            for size in output_partition_sizes:
                if size % 128:
                    raise ValueError(f"{prefix}: output size {size} of a merged or sharded "
                                     "layer is not divisible by the weight block size 128")
        if input_size_per_partition != input_size and input_size_per_partition % 128:
            raise ValueError(f"{prefix}: input size {input_size_per_partition} per rank is not "
                             "divisible by the weight block size 128")

    def process_weights_after_loading(self, layer: Any) -> None:
        weight = layer.weight.data
        if self.block:
            return  # weight [N, K] and weight_scale_inv as loaded
        if not self.quant_config.is_checkpoint_fp8_serialized:
            qweight, scale = _ops.scaled_fp8_quant(weight.reshape(-1, weight.shape[-1]))
            replace_parameter(layer, "weight", qweight.t())
            replace_parameter(layer, "weight_scale", scale)
            return
        scales = layer.weight_scale.data
        if bool((scales == torch.finfo(torch.float32).min).any()):
            raise ValueError(f"{getattr(layer, 'prefix', '')}: the checkpoint has no "
                             "weight_scale for some shard")
        replace_parameter(layer, "weight", weight.t())
        replace_parameter(layer, "weight_scale",
                          per_tensor_to_channelwise(scales, layer.output_partition_sizes))
        if self.static_input:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))

    def skinny_weight(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight [N, K] e4m3, weight_scale [1] or [N]) for the fused decode path
        (pyorch/layers/fused_linear.py, skinny_gemm_fp8); None for block-wise weights."""
        if self.block or layer.weight.dtype != torch.float8_e4m3fn:
            return None
        return layer.weight.t(), layer.weight_scale

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.block:
            return apply_fp8_block_linear(x, layer.weight, layer.weight_scale_inv, bias)
        input_scale = layer.input_scale if self.static_input else None
        return apply_fp8_linear(x, layer.weight, layer.weight_scale, input_scale, bias,
                                per_token=True)
