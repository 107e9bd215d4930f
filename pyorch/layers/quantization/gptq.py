"""GPTQ checkpoints (`quantization_config.quant_method == "gptq"`), 4-bit symmetric, served by
pyorch's W4A16 kernel on the CPU and the GPU (vLLM's `gptq` / `gptq_marlin`: both names are
accepted and run the same kernel).

Checkpoint tensors per linear layer [N = out, K = in] (AutoGPTQ / GPTQModel, format "gptq" v1):
qweight [K / 8, N] int32 (packed along K), qzeros [G, N / 8] int32 (zero - 1, packed along N),
scales [G, N] float16, g_idx [K] int32 (each input row's group). Supported: bits = 4, sym =
True (uint4b8: w = (q - 8) * s; the checkpoint's qzeros are checked to say so), group_size
32/64/128/-1, desc_act (act-order: the rows are sorted by group at load and the activations
permuted at run time; the groups must hold group_size rows each, as GPTQ writes them),
checkpoint_format "gptq" (v1) or "gptq_v2" (no off-by-one). Refused with a clear error: other
bit widths, sym = False, `dynamic` per-module overrides, `lm_head` quantization,
`modules_in_block_to_quantize`, and act-order on a row-parallel layer split over ranks (vLLM
keeps the whole g_idx and scales there; pyorch does not yet).
"""

from typing import Any, cast

import torch
from torch import nn

from pyorch import _ops
from pyorch.layers.linear import LinearBase, LinearMethodBase
from pyorch.layers.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)
from pyorch.layers.quantization import QuantizationConfig, register_quantization_config
from pyorch.layers.quantization.w4a16_linear import (
    act_dtype,
    apply_w4a16,
    check_w4a16_shape,
    replace_parameters,
    set_w4a16_weights,
    unpack_cols,
)
from pyorch.scalar_type import scalar_types

_PLAIN_ORDER = list(range(8))


@register_quantization_config("gptq")
class GPTQConfig(QuantizationConfig):
    """GPTQ 4-bit symmetric weights (see the module docstring for what is supported)."""

    def __init__(self, weight_bits: int, group_size: int, desc_act: bool, sym: bool = True,
                 checkpoint_format: str = "gptq", lm_head_quantized: bool = False,
                 dynamic: dict[str, Any] | None = None,
                 modules_in_block_to_quantize: list[Any] | None = None) -> None:
        name = self.get_name()
        if weight_bits != 4:
            raise ValueError(f"{name}: only 4-bit GPTQ is supported, this checkpoint has "
                             f"bits={weight_bits}")
        if not sym:
            raise ValueError(f"{name}: only symmetric GPTQ (sym=true) is supported")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"{name}: checkpoint_format {checkpoint_format!r} is not supported "
                             "(gptq or gptq_v2)")
        if lm_head_quantized:
            raise ValueError(f"{name}: a quantized lm_head (lm_head=true) is not supported")
        if dynamic:
            raise ValueError(f"{name}: per-module `dynamic` overrides are not supported")
        if modules_in_block_to_quantize:
            raise ValueError(f"{name}: `modules_in_block_to_quantize` is not supported")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.quant_type = scalar_types.uint4b8
        if group_size not in (-1, 32, 64, 128):
            raise ValueError(f"{name}: group_size {group_size} is not supported "
                             "(32, 64, 128 or -1)")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(weight_bits={self.weight_bits}, group_size="
                f"{self.group_size}, desc_act={self.desc_act}, checkpoint_format="
                f"{self.checkpoint_format})")

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]  # float32: the CPU kernel

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        return cls(
            weight_bits=cls.get_from_keys(config, ["bits", "w_bit"]),
            group_size=cls.get_from_keys(config, ["group_size", "q_group_size"]),
            desc_act=bool(cls.get_from_keys_or(config, ["desc_act"], False)),
            sym=bool(cls.get_from_keys_or(config, ["sym"], True)),
            checkpoint_format=cls.get_from_keys_or(config, ["checkpoint_format"], "gptq"),
            lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
            dynamic=cls.get_from_keys_or(config, ["dynamic"], None),
            modules_in_block_to_quantize=cls.get_from_keys_or(
                config, ["modules_in_block_to_quantize"], None),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> "GPTQLinearMethod | None":
        if isinstance(layer, LinearBase):
            return GPTQLinearMethod(self)
        return None


@register_quantization_config("gptq_marlin")
class GPTQMarlinConfig(GPTQConfig):
    """vLLM's name for GPTQ on its Marlin kernel; in pyorch the same method as `gptq`."""

    @classmethod
    def get_name(cls) -> str:
        return "gptq_marlin"

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        if str(hf_quant_cfg.get("quant_method", "")).lower() == "gptq" and (
                user_quant == "gptq_marlin"):
            return "gptq_marlin"
        return None


class GPTQLinearMethod(LinearMethodBase):
    """Creates GPTQ's checkpoint parameters and repacks them for pyorch's W4A16 kernel."""

    def __init__(self, config: GPTQConfig) -> None:
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
        if row_split and cfg.desc_act:
            raise NotImplementedError(
                f"{name}: act-order (desc_act) GPTQ on a row-parallel layer split over "
                "tensor-parallel ranks is not supported; run with tensor_parallel_size=1 or a "
                "checkpoint without desc_act")
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        loader = extra_weight_attrs["weight_loader"]
        # Per-channel scales, or act-order's, are whole along the input on every rank.
        groups_whole = cfg.group_size == -1 and row_split
        num_groups = 1 if cfg.group_size == -1 else k // cfg.group_size
        qweight = PackedvLLMParameter(
            torch.empty(k // 8, n, dtype=torch.int32), output_dim=1, input_dim=0, packed_dim=0,
            packed_factor=8, weight_loader=loader)
        g_idx = RowvLLMParameter(torch.empty(k, dtype=torch.int32), input_dim=0,
                                 weight_loader=_same_g_idx_loader(loader, name))
        if groups_whole:
            scales: BasevLLMParameter = ChannelQuantScaleParameter(
                torch.empty(1, n, dtype=params_dtype), output_dim=1, weight_loader=loader)
            qzeros: BasevLLMParameter = PackedvLLMParameter(
                torch.empty(1, n // 8, dtype=torch.int32), output_dim=1,
                input_dim=None,  # type: ignore[arg-type]  # one group for every rank
                packed_dim=1, packed_factor=8, weight_loader=loader)
        else:
            scales = GroupQuantScaleParameter(
                torch.empty(num_groups, n, dtype=params_dtype), output_dim=1, input_dim=0,
                weight_loader=loader)
            qzeros = PackedvLLMParameter(
                torch.empty(num_groups, n // 8, dtype=torch.int32), output_dim=1, input_dim=0,
                packed_dim=1, packed_factor=8, weight_loader=loader)
        for pname, param in (("qweight", qweight), ("g_idx", g_idx), ("qzeros", qzeros),
                             ("scales", scales)):
            layer.register_parameter(pname, param)
        group_size = k if cfg.group_size == -1 else cfg.group_size
        row_offset = cast(int, getattr(layer, "tp_rank", 0)) * k if row_split else 0
        layer.gptq_group_size = group_size  # type: ignore[assignment]
        layer.gptq_row_offset = row_offset  # type: ignore[assignment]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        qweight = cast(torch.Tensor, layer.qweight).data
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        group_size = cast(int, layer.gptq_group_size)
        # Symmetric codes: every zero point is 8, stored minus one in the v1 format.
        expected_zero = 8 - 1 if cfg.checkpoint_format == "gptq" else 8
        zeros = unpack_cols(cast(torch.Tensor, layer.qzeros).data, _PLAIN_ORDER)
        if not bool((zeros == expected_zero).all()):
            raise ValueError(
                f"{cfg.get_name()}: {getattr(layer, 'prefix', '')} qzeros are not those of "
                f"symmetric 4-bit GPTQ (stored {expected_zero} everywhere for checkpoint_format "
                f"{cfg.checkpoint_format!r}); asymmetric GPTQ is not supported")
        g_idx = cast(torch.Tensor, layer.g_idx).data.to(torch.int64)
        perm = None
        if cfg.desc_act:
            perm = torch.argsort(g_idx, stable=True)
            g_idx = g_idx[perm]
        expected = (torch.arange(k, device=g_idx.device)
                    + cast(int, layer.gptq_row_offset)) // group_size
        if not torch.equal(g_idx, expected):
            raise ValueError(
                f"{cfg.get_name()}: {getattr(layer, 'prefix', '')} g_idx does not put "
                f"group_size={group_size} rows in each group "
                f"{'(after sorting, desc_act)' if cfg.desc_act else '(desc_act=false)'}: "
                "pyorch's kernel needs equal groups")
        perm32 = perm.to(torch.int32) if perm is not None else None
        repacked = _ops.gptq_marlin_repack(qweight.contiguous(), perm32, k, n, 4)
        scales = cast(torch.Tensor, layer.scales).data
        set_w4a16_weights(layer, repacked, scales, None, perm32, cfg.quant_type,
                          act_dtype(layer))
        replace_parameters(layer, ["qweight", "qzeros", "scales", "g_idx"])

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_w4a16(layer, x, bias)


def _same_g_idx_loader(loader: Any, name: str) -> Any:
    """A merged layer (qkv, gate_up) has one g_idx for its shards, as in vLLM: every shard's
    must be the same (GPTQ's act-order comes from the shared input), else the load fails."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, *shard: Any) -> None:
        previous = param.data.clone() if getattr(param, "w4_loaded", False) else None
        loader(param, loaded_weight, *shard)
        if previous is not None and not torch.equal(previous, param.data):
            raise ValueError(f"{name}: the merged shards have different g_idx (act-order); "
                             "pyorch's kernel needs one order per merged layer")
        param.w4_loaded = True  # type: ignore[attr-defined]

    return load
