"""Parameter classes of quantized layers (vLLM's names): each says how a checkpoint tensor maps
onto this rank's shard, and the linear layers' weight loaders follow them
(pyorch/layers/linear.py). They are `nn.Parameter`s with loading metadata:

- `ModelWeightParameter(output_dim, input_dim)`: sharded along both as the layer is (a weight,
  a zero point, a group-scale grid). `GroupQuantScaleParameter` is the same for group scales.
- `ChannelQuantScaleParameter(output_dim)`: one value per output channel ([N] or [N, 1]).
- `PerTensorScaleParameter`: one value per merged shard ([num_shards]: q/k/v, gate/up), loaded
  at the shard's index; the method requantizes to one scale after loading (vLLM's way).
- `BlockQuantScaleParameter(output_dim, input_dim, block_size)`: one value per [block_n, block_k]
  weight block; shard offsets along the output are in blocks.
- `PackedvLLMParameter(..., packed_dim, packed_factor)`: packed_factor values per element along
  packed_dim (int4 in int32: 8); shard offsets along a packed output dim are divided by it.
- `RowvLLMParameter(input_dim)`: sharded along the input only (e.g. GPTQ's g_idx).
- `BasevLLMParameter`: loaded whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[..., None]


class BasevLLMParameter(nn.Parameter):
    """A parameter with a weight loader, loaded whole (no sharding)."""

    output_dim: int | None = None
    input_dim: int | None = None
    packed_dim: int | None = None
    packed_factor: int = 1

    def __new__(cls, data: torch.Tensor, **kwargs: Any) -> BasevLLMParameter:
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader: WeightLoader | None = None):
        self.weight_loader = weight_loader

    def output_shard(self, offset: int, size: int) -> tuple[int, int]:
        """(offset, size) along output_dim of a merged shard at logical rows [offset, +size)."""
        return offset, size


class RowvLLMParameter(BasevLLMParameter):
    """Sharded along input_dim only."""

    def __init__(
        self, data: torch.Tensor, input_dim: int, weight_loader: WeightLoader | None = None
    ):
        super().__init__(data, weight_loader)
        self.input_dim = input_dim


class ModelWeightParameter(BasevLLMParameter):
    """Sharded along output_dim (column-parallel) and input_dim (row-parallel)."""

    def __init__(
        self, data: torch.Tensor, output_dim: int, input_dim: int,
        weight_loader: WeightLoader | None = None,
    ):
        super().__init__(data, weight_loader)
        self.output_dim = output_dim
        self.input_dim = input_dim


class GroupQuantScaleParameter(ModelWeightParameter):
    """Group scales / zero points ([K / group_size, N] or [N, K / group_size])."""


class ChannelQuantScaleParameter(BasevLLMParameter):
    """One value per output channel, sharded along output_dim."""

    def __init__(
        self, data: torch.Tensor, output_dim: int, weight_loader: WeightLoader | None = None
    ):
        super().__init__(data, weight_loader)
        self.output_dim = output_dim


class PerTensorScaleParameter(BasevLLMParameter):
    """One scale per merged shard: data [num_shards]; loaders write index shard_index."""


class BlockQuantScaleParameter(ModelWeightParameter):
    """One scale per weight block: [ceil(N / block_n), ceil(K / block_k)]."""

    def __init__(
        self, data: torch.Tensor, output_dim: int, input_dim: int, block_size: tuple[int, int],
        weight_loader: WeightLoader | None = None,
    ):
        super().__init__(data, output_dim, input_dim, weight_loader)
        self.block_size = block_size

    def output_shard(self, offset: int, size: int) -> tuple[int, int]:
        block_n = self.block_size[0]
        return offset // block_n, -(-size // block_n)


class PackedvLLMParameter(ModelWeightParameter):
    """packed_factor values per stored element along packed_dim (e.g. 8 int4 per int32)."""

    def __init__(
        self, data: torch.Tensor, output_dim: int, input_dim: int, packed_dim: int,
        packed_factor: int, weight_loader: WeightLoader | None = None,
    ):
        super().__init__(data, output_dim, input_dim, weight_loader)
        self.packed_dim = packed_dim
        self.packed_factor = packed_factor

    def output_shard(self, offset: int, size: int) -> tuple[int, int]:
        if self.packed_dim != self.output_dim:
            return offset, size
        if offset % self.packed_factor or size % self.packed_factor:
            raise ValueError(f"a merged shard at rows [{offset}, {offset + size}) does not fall "
                             f"on the packing of {self.packed_factor} values per element")
        return offset // self.packed_factor, size // self.packed_factor


class PackedColumnParameter(PackedvLLMParameter):
    """Packed along the output dim (vLLM's name for AWQ-style packing)."""
