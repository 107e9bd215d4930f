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
  the model dtype.
- Mixture-of-experts layers (`Fp8MoEMethod`, vLLM's parameter names): fp8 expert weights with one
  per-tensor scale per expert (`w13_weight_scale`, `w2_weight_scale`; online: quantized at load,
  one scale per expert over gate and up; checkpoints: per-shard scales, gate and up requantized
  to their max as vLLM does), activations quantized per tensor (dynamic, or the max of the
  static `w13_input_scale` / `w2_input_scale`), run by the grouped expert GEMM
  (fused_experts_grouped; CUDA needs sm90). bf16 activations only. Block-wise fp8 experts
  (`weight_block_size`) are refused: the grouped GEMM has no block-scaled form yet.
"""

from __future__ import annotations

from typing import Any

import torch

from pyorch import _ops
from pyorch.layers.fused_moe.fused_moe import fused_experts_grouped, fused_topk
from pyorch.layers.fused_moe.layer import FusedMoE
from pyorch.layers.linear import LinearBase, LinearMethodBase, set_weight_attrs
from pyorch.layers.parameter import (
    BlockQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from pyorch.layers.quantization import (
    QuantizationConfig,
    QuantizeMethodBase,
    is_layer_skipped,
    online_weight_device,
    register_quantization_config,
)
from pyorch.layers.quantization.utils.w8a8_utils import (
    apply_fp8_block_linear,
    apply_fp8_linear,
    per_tensor_to_channelwise,
    replace_parameter,
)

ACTIVATION_SCHEMES = ("static", "dynamic")
# A scale no checkpoint tensor has written (float32 explicitly: a bf16 default dtype overflows).
_UNSET = torch.finfo(torch.float32).min


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
        if isinstance(layer, FusedMoE):
            return None if self.is_layer_skipped(prefix) else Fp8MoEMethod(self)
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
        # Online: the float weight lives only while its layer loads (online_weight_device).
        device = None if serialized else online_weight_device()
        layer.register_parameter("weight", ModelWeightParameter(
            torch.empty(n, input_size_per_partition, dtype=weight_dtype, device=device),
            output_dim=0, input_dim=1, weight_loader=loader))
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
            torch.full((shards,), _UNSET, dtype=torch.float32), weight_loader=loader))
        if self.static_input:
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                torch.full((shards,), _UNSET, dtype=torch.float32), weight_loader=loader))

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

    def accepts_fp8_activation(self, layer: Any) -> bool:
        """Whether apply takes an Fp8Activation (w8a8_utils.rms_norm_fp8_input): dynamic
        per-token activations against per-tensor or per-channel e4m3 weights."""
        return (not self.block and not self.static_input
                and layer.weight.dtype == torch.float8_e4m3fn)

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



class Fp8MoEMethod(QuantizeMethodBase):
    """fp8 experts of a FusedMoE layer (see the module docstring)."""

    @property
    def online_weights_meta(self) -> bool:
        """FusedMoE creates its float expert weights on the meta device (under the loader's
        online_weights_on_meta) for a method that quantizes them after loading."""
        return not self.quant_config.is_checkpoint_fp8_serialized

    def __init__(self, quant_config: Fp8Config):
        if quant_config.weight_block_size is not None:
            raise NotImplementedError(
                "fp8: block-wise (weight_block_size) mixture-of-experts weights are not supported "
                "yet (the grouped expert GEMM takes one scale per expert); list the experts in "
                "ignored_layers or use a per-tensor fp8 checkpoint")
        self.quant_config = quant_config
        self.static_input = quant_config.activation_scheme == "static"

    def create_weights(  # type: ignore[override]
        self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        if params_dtype != torch.bfloat16:
            raise ValueError(f"fp8 mixture-of-experts layers take bfloat16 activations; the model "
                             f"dtype is {params_dtype} (use --dtype bfloat16)")
        if not self.quant_config.is_checkpoint_fp8_serialized:
            # bf16 weights as loaded (FusedMoE's w13_weight / w2_weight, on the meta device under
            # the loader: see online_weights_meta); quantized in process_weights_after_loading.
            return
        fp8 = _ops.FP8_DTYPE
        shapes = {"w13_weight": (num_experts, 2 * intermediate_size, hidden_size),
                  "w2_weight": (num_experts, hidden_size, intermediate_size)}
        for name, shape in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=fp8), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": layer.weight_loader})
            layer.register_parameter(name, param)
        scales: dict[str, tuple[int, ...]] = {"w13_weight_scale": (num_experts, 2),
                                              "w2_weight_scale": (num_experts,)}
        if self.static_input:
            scales.update(w13_input_scale=(num_experts,), w2_input_scale=(num_experts,))
        for name, scale_shape in scales.items():
            param = torch.nn.Parameter(torch.full(scale_shape, _UNSET, dtype=torch.float32),
                                       requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self._scale_loader(layer)})
            layer.register_parameter(name, param)

    @staticmethod
    def _scale_loader(layer: FusedMoE) -> Any:
        def load(param: torch.nn.Parameter, loaded: torch.Tensor, weight_name: str,
                 shard_id: str, expert_id: int) -> None:
            """One expert's per-tensor scale: w13_weight_scale[e, 0 gate / 1 up],
            w2_weight_scale[e]; input scales keep the max of gate's and up's."""
            if loaded.numel() != 1:
                raise ValueError(f"{weight_name}: expected one per-tensor scale, got shape "
                                 f"{tuple(loaded.shape)} (per-channel fp8 experts are not "
                                 "supported)")
            local = layer.local_expert(expert_id)
            if local is None:
                return
            value = loaded.reshape(()).to(torch.float32)
            if param.dim() == 2:
                param.data[local, 0 if shard_id == "w1" else 1] = value
            else:
                param.data[local] = torch.maximum(param.data[local], value)
        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        assert isinstance(layer, FusedMoE)
        device = layer.w13_weight.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
            raise NotImplementedError("fp8 mixture-of-experts layers run on sm90 (Hopper) GPUs "
                                      "only: the grouped expert GEMM is built for sm90a")
        if not self.quant_config.is_checkpoint_fp8_serialized:
            w13, s13 = self._quantize(layer.w13_weight.data)
            w2, s2 = self._quantize(layer.w2_weight.data)
        else:
            for name in ("w13_weight_scale", "w2_weight_scale"):
                if bool((getattr(layer, name).data == _UNSET).any()):
                    raise ValueError(f"{getattr(layer, 'prefix', 'FusedMoE')}: the checkpoint "
                                     f"has no {name} for some expert")
            w13, s13 = self._requantize_to_max(layer.w13_weight.data,
                                               _tensor(layer, "w13_weight_scale"))
            w2, s2 = layer.w2_weight.data, _tensor(layer, "w2_weight_scale")
            if self.static_input:
                for name in ("w13_input_scale", "w2_input_scale"):
                    scale = getattr(layer, name).data
                    if bool((scale == _UNSET).any()):
                        raise ValueError(f"the checkpoint has no {name} for some expert")
                    replace_parameter(layer, name, scale.max().reshape(1))
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)
        replace_parameter(layer, "w13_weight_scale", s13)
        replace_parameter(layer, "w2_weight_scale", s2)

    @staticmethod
    def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, N, K] float -> fp8 with one dynamic per-tensor scale per expert ([E] float32)."""
        q = torch.empty(w.shape, dtype=_ops.FP8_DTYPE, device=w.device)
        scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for e in range(w.shape[0]):
            q[e], s = _ops.scaled_fp8_quant(w[e].reshape(-1, w.shape[-1]))
            scales[e] = s.reshape(())
        return q, scales

    @staticmethod
    def _requantize_to_max(w13: torch.Tensor, scales: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, 2I, H] fp8 with per-shard scales [E, 2] -> one scale per expert (the max); the
        shard whose scale was smaller is requantized (vLLM's choice)."""
        half = w13.shape[1] // 2
        out = w13.clone()
        new = scales.max(dim=1).values
        for e in range(w13.shape[0]):
            for j in range(2):
                if bool(scales[e, j] != new[e]):
                    rows = slice(j * half, (j + 1) * half)
                    deq = w13[e, rows].to(torch.float32) * scales[e, j]
                    out[e, rows], _ = _ops.scaled_fp8_quant(deq, new[e].reshape(1))
        return out, new.contiguous()

    def apply(  # type: ignore[override]
        self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        topk_weights, topk_ids = fused_topk(router_logits, layer.top_k, layer.renormalize)
        return fused_experts_grouped(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.global_num_experts, layer.expert_map, _tensor(layer, "w13_weight_scale"),
            _tensor(layer, "w2_weight_scale"),
            _tensor(layer, "w13_input_scale") if self.static_input else None,
            _tensor(layer, "w2_input_scale") if self.static_input else None,
        )


def _tensor(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter the method registered on the layer, typed."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), name
    return value
