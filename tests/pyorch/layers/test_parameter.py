"""Quantized parameters through the linear layers' weight loaders: per-tensor scales land at
their merged shard's index, per-channel scales and packed / block-scale rows follow the tensor-
parallel sharding of the weight they belong to."""

from typing import Any

import pytest
import torch
from torch import nn

from pyorch.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pyorch.layers.parameter import (
    BlockQuantScaleParameter,
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)


class _RecordingMethod(LinearMethodBase):
    """Creates one parameter of each kind; apply is not needed here."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra: Any) -> None:
        loader = extra["weight_loader"]
        n, k = sum(output_partition_sizes), input_size_per_partition
        layer.register_parameter("weight", ModelWeightParameter(
            torch.zeros(n, k), output_dim=0, input_dim=1, weight_loader=loader))
        layer.register_parameter("weight_scale", PerTensorScaleParameter(
            torch.zeros(len(output_partition_sizes)), weight_loader=loader))
        layer.register_parameter("channel_scale", ChannelQuantScaleParameter(
            torch.zeros(n, 1), output_dim=0, weight_loader=loader))
        layer.register_parameter("qweight", PackedvLLMParameter(
            torch.zeros(n // 8, k, dtype=torch.int32), output_dim=0, input_dim=1, packed_dim=0,
            packed_factor=8, weight_loader=loader))
        layer.register_parameter("block_scale", BlockQuantScaleParameter(
            torch.zeros(-(-n // 128), -(-k // 128)), output_dim=0, input_dim=1,
            block_size=(128, 128), weight_loader=loader))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        raise NotImplementedError


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_merged_column_parallel_loads_quantized_params(tp_rank: int):
    sizes, k = [256, 512], 384
    layer = MergedColumnParallelLinear(k, sizes, bias=False, quant_method=_RecordingMethod(),
                                       tp_rank=tp_rank, tp_size=2)
    full = {name: torch.randn(s, k) for name, s in zip(("gate", "up"), sizes, strict=True)}
    for shard_id, name in enumerate(("gate", "up")):
        w = full[name]
        layer.weight_loader(layer.weight, w, shard_id)
        layer.weight_loader(layer.weight_scale, torch.tensor(0.5 + shard_id), shard_id)
        layer.weight_loader(layer.channel_scale, w[:, :1], shard_id)
        layer.weight_loader(layer.qweight, torch.arange(w.shape[0] // 8 * k, dtype=torch.int32)
                            .reshape(-1, k) + 1000 * shard_id, shard_id)
        blocks = torch.arange(-(-w.shape[0] // 128) * 3, dtype=torch.float32).reshape(-1, 3)
        layer.weight_loader(layer.block_scale, blocks + 100 * shard_id, shard_id)
    half = [s // 2 for s in sizes]
    expected_w = torch.cat([full["gate"].chunk(2)[tp_rank], full["up"].chunk(2)[tp_rank]])
    torch.testing.assert_close(layer.weight.data, expected_w)
    torch.testing.assert_close(layer.weight_scale.data, torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(layer.channel_scale.data, expected_w[:, :1])
    # Packed rows: 8 per int32 row, this rank's half of each shard at the shard's packed offset.
    gate_rows = half[0] // 8
    packed_gate = torch.arange(sizes[0] // 8 * k, dtype=torch.int32).reshape(-1, k)
    torch.testing.assert_close(layer.qweight.data[:gate_rows], packed_gate.chunk(2)[tp_rank])
    # Block rows: 128 output rows per block row.
    assert layer.block_scale.shape == (3, 3)
    torch.testing.assert_close(layer.block_scale.data[0], torch.arange(3.0) + 3 * tp_rank)


def test_qkv_per_tensor_scales_by_shard_and_fused():
    layer = QKVParallelLinear(128, 32, 4, 2, bias=False, quant_method=_RecordingMethod(),
                              tp_rank=0, tp_size=1)
    for index, shard in enumerate("qkv"):
        layer.weight_loader(layer.weight_scale, torch.tensor([2.0 + index]), shard)
    torch.testing.assert_close(layer.weight_scale.data, torch.tensor([2.0, 3.0, 4.0]))
    layer.weight_loader(layer.weight_scale, torch.tensor(7.0))  # an already-fused checkpoint
    torch.testing.assert_close(layer.weight_scale.data, torch.tensor([7.0, 7.0, 7.0]))
    with pytest.raises(ValueError, match="a per-tensor scale has one value"):
        layer.weight_loader(layer.weight_scale, torch.ones(2), "q")


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_row_parallel_shards_quantized_params_along_input(tp_rank: int):
    layer = RowParallelLinear(512, 256, bias=False, quant_method=_RecordingMethod(),
                              tp_rank=tp_rank, tp_size=2)
    w = torch.randn(256, 512)
    layer.weight_loader(layer.weight, w)
    torch.testing.assert_close(layer.weight.data, w.chunk(2, dim=1)[tp_rank])
    layer.weight_loader(layer.weight_scale, torch.tensor([0.25]))
    assert layer.weight_scale.item() == 0.25
    blocks = torch.arange(8.0).reshape(2, 4)  # [256 / 128, 512 / 128]
    layer.weight_loader(layer.block_scale, blocks)
    torch.testing.assert_close(layer.block_scale.data, blocks.chunk(2, dim=1)[tp_rank])
