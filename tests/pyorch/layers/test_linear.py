"""Linear layers: weight_loader places each checkpoint shard at the right rows for each rank."""

import pytest
import torch

from pyorch.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from pyorch.layers.quantization import QuantizeMethodBase


def test_replicated_forward_matches_f_linear():
    layer = ReplicatedLinear(33, 17, bias=True)
    w, b = torch.randn(17, 33), torch.randn(17)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    x = torch.randn(5, 33)
    torch.testing.assert_close(layer(x), x @ w.T + b)
    with pytest.raises(ValueError, match="Shape mismatch"):
        layer.weight_loader(layer.weight, torch.randn(17, 32))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_column_and_row_shards(tp_size: int):
    w_col, b_col = torch.randn(8, 6), torch.randn(8)
    w_row = torch.randn(6, 8)
    for rank in range(tp_size):
        col = ColumnParallelLinear(6, 8, bias=True, tp_rank=rank, tp_size=tp_size)
        col.weight_loader(col.weight, w_col)
        col.weight_loader(col.bias, b_col)
        n = 8 // tp_size
        torch.testing.assert_close(col.weight.data, w_col[rank * n:(rank + 1) * n])
        torch.testing.assert_close(col.bias.data, b_col[rank * n:(rank + 1) * n])
        row = RowParallelLinear(8, 6, bias=False, tp_rank=rank, tp_size=tp_size)
        row.weight_loader(row.weight, w_row)
        torch.testing.assert_close(row.weight.data, w_row[:, rank * n:(rank + 1) * n])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_gate_up_shards(tp_size: int):
    inter, hidden = 12, 5
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, tp_rank=rank,
                                           tp_size=tp_size)
        layer.weight_loader(layer.weight, up, 1)  # order of arrival does not matter
        layer.weight_loader(layer.weight, gate, 0)
        n = inter // tp_size
        want = torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]])
        torch.testing.assert_close(layer.weight.data, want)
        fused = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, tp_rank=rank,
                                           tp_size=tp_size)
        fused.weight_loader(fused.weight, torch.cat([gate, up]))  # an already-merged tensor
        torch.testing.assert_close(fused.weight.data, want)


@pytest.mark.parametrize("tp_size,num_kv_heads", [(1, 2), (2, 2), (4, 2)])
def test_qkv_shards(tp_size: int, num_kv_heads: int):
    hidden, head, num_heads = 16, 4, 8
    q = torch.randn(num_heads * head, hidden)
    k = torch.randn(num_kv_heads * head, hidden)
    v = torch.randn(num_kv_heads * head, hidden)
    bq, bk, bv = torch.randn(num_heads * head), torch.randn(num_kv_heads * head), torch.randn(
        num_kv_heads * head)
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head, num_heads, num_kv_heads, bias=True, tp_rank=rank,
                                  tp_size=tp_size)
        for shard_id, w, b in (("v", v, bv), ("q", q, bq), ("k", k, bk)):
            layer.weight_loader(layer.weight, w, shard_id)
            layer.weight_loader(layer.bias, b, shard_id)
        nq = num_heads // tp_size * head
        kv_rank = rank // layer.num_kv_head_replicas
        nkv = layer.num_kv_heads * head
        want_w = torch.cat([q[rank * nq:(rank + 1) * nq], k[kv_rank * nkv:(kv_rank + 1) * nkv],
                            v[kv_rank * nkv:(kv_rank + 1) * nkv]])
        want_b = torch.cat([bq[rank * nq:(rank + 1) * nq], bk[kv_rank * nkv:(kv_rank + 1) * nkv],
                            bv[kv_rank * nkv:(kv_rank + 1) * nkv]])
        torch.testing.assert_close(layer.weight.data, want_w)
        torch.testing.assert_close(layer.bias.data, want_b)
    with pytest.raises(ValueError, match="shard id"):
        layer.weight_loader(layer.weight, q, "x")


def test_qkv_fused_checkpoint_and_forward():
    layer = QKVParallelLinear(16, 4, 4, 2, bias=False)
    w = torch.randn((4 + 2 * 2) * 4, 16)
    layer.weight_loader(layer.weight, w)
    torch.testing.assert_close(layer.weight.data, w)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ w.T)


def test_quant_method_is_pluggable():
    class Doubled(UnquantizedLinearMethod):
        def apply(self, layer, x, bias=None):  # type: ignore[no-untyped-def]
            return 2 * super().apply(layer, x, bias)

    layer = ReplicatedLinear(4, 3, bias=False, quant_method=Doubled())
    assert isinstance(layer.quant_method, QuantizeMethodBase)
    layer.weight.data.copy_(torch.eye(3, 4))
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), 2 * x[:, :3])


def test_indivisible_tp_raises():
    with pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(4, 6, tp_size=4)
