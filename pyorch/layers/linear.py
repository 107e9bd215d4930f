"""Linear layers with tensor-parallel sharding and pluggable quantization (vLLM's layer family).

Each layer holds `tp_rank`/`tp_size` and builds only its rank's partition of the weight;
`weight_loader(param, loaded_weight, shard_id)` narrows a full checkpoint tensor to that
partition and places merged shards (q/k/v, gate/up) at their offsets. Weights are created and
used by a `LinearMethodBase` (unquantized by default), so quantized methods can be dropped in:
the collectives act on the method's output, whatever the method.
The rank and size come from `pyorch.distributed` (rank 0 of 1 outside a tensor-parallel
worker); a column-parallel layer with gather_output all-gathers its output, a row-parallel
layer all-reduces its partial sums (reduce_results) and adds its bias once, after the sum.
"""

from abc import abstractmethod
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pyorch import _ops
from pyorch.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pyorch.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from pyorch.layers.parameter import PerTensorScaleParameter
from pyorch.layers.quantization import QuantizationConfig, QuantizeMethodBase

# Up to this many rows, a CUDA linear layer runs pyorch's skinny GEMM (a weight stream at ~copy
# bandwidth) instead of cuBLAS. bench/cpp/bench_gemm.cu on an H100, Llama-3-8B's layer GEMMs:
# at M = 1 and 8 it is 1.02-1.17x faster than cuBLAS per shape; at M = 16 (the kernel takes up to
# 16) its best configurations only tie cuBLAS's per-layer sum (163.4 against 163.8 us).
SKINNY_GEMM_MAX_TOKENS = 8
_SKINNY_GEMM_DTYPES = (torch.float16, torch.bfloat16)


def get_tensor_model_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of this process in the tensor-parallel group ((0, 1) without one)."""
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attaches loading metadata (weight_loader, input_dim, output_dim) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"Parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies a whole checkpoint tensor into a parameter of the same shape (casting dtype)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"Shape mismatch loading a weight: parameter {tuple(param.shape)}, "
            f"checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def load_per_tensor_scale(param: nn.Parameter, loaded_weight: torch.Tensor, index: int) -> None:
    """Writes a checkpoint's one-value scale into entry `index` of a [num_shards] parameter."""
    if loaded_weight.numel() != 1:
        raise ValueError(f"a per-tensor scale has one value, the checkpoint's has shape "
                         f"{tuple(loaded_weight.shape)}")
    param.data[index].copy_(loaded_weight.reshape(()))


def _stored_rows(param: nn.Parameter, offset: int, size: int) -> tuple[int, int]:
    """(offset, size) along a parameter's output dim of logical output rows [offset, +size):
    the same for a plain weight, fewer for packed or block-scale parameters (parameter.py)."""
    output_shard = getattr(param, "output_shard", None)
    return output_shard(offset, size) if output_shard is not None else (offset, size)


def use_skinny_gemm(
    x: torch.Tensor,  # [num_tokens, input_size]
    weight: torch.Tensor,  # [output_size, input_size]
    bias: torch.Tensor | None,  # [output_size]
) -> bool:
    """Whether x @ weight^T goes to the skinny GEMM: a CUDA fp16/bf16 product of few rows in the
    layouts its 16-byte loads need. Both paths are exact up to fp32 summation order; this is a
    choice by shape, and each side is the fast one for its shapes."""
    return (
        x.is_cuda
        and 0 < x.shape[0] <= SKINNY_GEMM_MAX_TOKENS
        and x.dtype in _SKINNY_GEMM_DTYPES
        and weight.dtype == x.dtype
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and x.shape[1] > 0
        and x.shape[1] % 8 == 0
        and x.stride(1) == 1
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and weight.is_contiguous()
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def linear(
    x: torch.Tensor,  # [..., input_size]
    weight: torch.Tensor,  # [output_size, input_size]
    bias: torch.Tensor | None = None,  # [output_size]
) -> torch.Tensor:  # [..., output_size]
    """F.linear, through the skinny GEMM when use_skinny_gemm says so (decode batches)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not use_skinny_gemm(x2, weight, bias):
        return F.linear(x, weight, bias)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _ops.skinny_gemm(out, x2, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class LinearMethodBase(QuantizeMethodBase):
    """Creates and applies a linear layer's weights."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Registers this rank's weight parameters on `layer`; output_partition_sizes lists the
        rank's share of each merged output (one entry for an unmerged layer)."""

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [..., input_size_per_partition]
        bias: torch.Tensor | None = None,  # [output_size_per_partition]
    ) -> torch.Tensor:  # [..., output_size_per_partition]
        """x @ W^T (+ bias) with the layer's weights."""


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain weight [output_size_per_partition, input_size_per_partition] in params_dtype."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # create_weights registered "weight" as a Parameter; nn.Module's stubs can't see it.
        return linear(x, cast(torch.Tensor, layer.weight), bias)


class LinearBase(nn.Module):
    """Common state: sizes, dtype, tensor-parallel position and the quantization method."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        """quant_config gives the layer named `prefix` its method (None: unquantized, as for a
        layer the config skips); quant_method sets one directly (tests)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if method is not None and not isinstance(method, LinearMethodBase):
            raise TypeError(f"{prefix}: {quant_config.get_name() if quant_config else ''} gave "
                            f"a linear layer a {type(method).__name__}, not a LinearMethodBase")
        self.quant_method: LinearMethodBase = method or quant_method or UnquantizedLinearMethod()
        default_rank, default_size = get_tensor_model_parallel_rank_and_size()
        self.tp_rank = default_rank if tp_rank is None else tp_rank
        self.tp_size = default_size if tp_size is None else tp_size
        self.bias: nn.Parameter | None = None

    def _create_bias(self, size: int, output_dim: int | None) -> None:
        bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        attrs: dict[str, Any] = {"weight_loader": self.weight_loader}
        if output_dim is not None:
            attrs["output_dim"] = output_dim
        set_weight_attrs(bias, attrs)
        self.bias = bias

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ReplicatedLinear(LinearBase):
    """A linear layer held whole on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, **kwargs: Any):
        super().__init__(input_size, output_size, **kwargs)
        self.quant_method.create_weights(
            self, input_size, [output_size], input_size, output_size, self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(output_size, output_dim=None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if isinstance(param, PerTensorScaleParameter):
            load_per_tensor_scale(param, loaded_weight, 0)
            return
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., output_size]
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W split along its output dim: rank r holds rows [r * n, (r + 1) * n)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        output_sizes: list[int] | None = None,
        **kwargs: Any,
    ):
        super().__init__(input_size, output_size, **kwargs)
        self.gather_output = gather_output
        self.output_sizes = output_sizes or [output_size]
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.quant_method.create_weights(
            self, input_size, [divide(s, self.tp_size) for s in self.output_sizes], input_size,
            output_size, self.params_dtype, weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(self.output_size_per_partition, output_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if isinstance(param, PerTensorScaleParameter):
            load_per_tensor_scale(param, loaded_weight, 0)
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            size = param.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        default_weight_loader(param, loaded_weight)

    def _copy_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int,
        shard_rank: int, shard_index: int,
    ) -> None:
        """Copies this rank's `size` rows of merged shard `shard_index` to rows
        [offset, offset + size) (in the parameter's own units: packed or block rows)."""
        if isinstance(param, PerTensorScaleParameter):  # one scale per shard
            load_per_tensor_scale(param, loaded_weight, shard_index)
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # replicated (e.g. a shared input scale): the same for every shard
            default_weight_loader(param, loaded_weight)
            return
        offset, size = _stored_rows(param, offset, size)  # packed or block-scale rows
        shard = loaded_weight.narrow(output_dim, shard_rank * size, size)
        default_weight_loader(param.data.narrow(output_dim, offset, size), shard)

    def _load_fused(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> bool:
        """Loads a checkpoint tensor that is not split by shard when its parameter is not split
        along the output either; False when the caller must split it."""
        if isinstance(param, PerTensorScaleParameter):  # one scale for every shard
            for index in range(param.shape[0]):
                load_per_tensor_scale(param, loaded_weight, index)
            return True
        if getattr(param, "output_dim", None) is None:
            default_weight_loader(param, loaded_weight)
            return True
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., out / tp]
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one GEMM (e.g. gate_up_proj);
    checkpoint tensors are loaded per shard with shard_id = their index in output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, **kwargs: Any):
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes, **kwargs)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        if loaded_shard_id is None:  # an already-merged checkpoint tensor: split and recurse
            if self._load_fused(param, loaded_weight):
                return
            output_dim = param.output_dim  # type: ignore[attr-defined]
            offset = 0
            for shard_id, size in enumerate(self.output_sizes):
                shard = loaded_weight.narrow(output_dim, *_stored_rows(param, offset, size))
                self.weight_loader(param, shard, shard_id)
                offset += size
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {loaded_shard_id} out of range for {self.output_sizes}")
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        size = self.output_sizes[loaded_shard_id] // self.tp_size
        self._copy_shard(param, loaded_weight, offset, size, self.tp_rank, loaded_shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q, k, v projection. Heads are split over ranks; when there are fewer kv heads
    than ranks, each kv head is replicated on tp_size / total_num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        **kwargs: Any,
    ):
        tp_size = kwargs.get("tp_size")
        tp_size = get_tensor_model_parallel_rank_and_size()[1] if tp_size is None else tp_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size = self.num_heads * head_size * tp_size
        kv_size = self.num_kv_heads * head_size * tp_size
        super().__init__(
            hidden_size, q_size + 2 * kv_size, bias, output_sizes=[q_size, kv_size, kv_size],
            **kwargs,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if loaded_shard_id is None:  # an already-fused qkv checkpoint tensor
            if self._load_fused(param, loaded_weight):
                return
            output_dim = param.output_dim  # type: ignore[attr-defined]
            total_q = self.total_num_heads * self.head_size
            total_kv = self.total_num_kv_heads * self.head_size
            for shard_id, offset, size in (
                ("q", 0, total_q), ("k", total_q, total_kv), ("v", total_q + total_kv, total_kv)
            ):
                shard = loaded_weight.narrow(output_dim, *_stored_rows(param, offset, size))
                self.weight_loader(param, shard, shard_id)
            return
        layout = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        if loaded_shard_id not in layout:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', not "
                             f"{loaded_shard_id!r}")
        offset, size = layout[loaded_shard_id]
        shard_rank = (
            self.tp_rank if loaded_shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        )
        self._copy_shard(
            param, loaded_weight, offset, size, shard_rank, "qkv".index(loaded_shard_id)
        )


class RowParallelLinear(LinearBase):
    """Y = X W^T with W split along its input dim; the partial outputs are summed over ranks
    (reduce_results). The bias is added once, after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        **kwargs: Any,
    ):
        super().__init__(input_size, output_size, **kwargs)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.quant_method.create_weights(
            self, self.input_size_per_partition, [output_size], input_size, output_size,
            self.params_dtype, weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(output_size, output_dim=None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if isinstance(param, PerTensorScaleParameter):
            load_per_tensor_scale(param, loaded_weight, 0)
            return
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            size = param.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * size, size)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / tp] -> [..., output_size]
        """x is this rank's slice of the input ([..., input_size / tp]) when input_is_parallel,
        else the whole input ([..., input_size]), of which the rank takes its slice."""
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if not self.input_is_parallel:
            size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * size, size)
        # The bias joins one rank's partial sum, so the reduction adds it once.
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        if not self.reduce_results:
            return out
        return tensor_model_parallel_all_reduce(out)
