"""Linear layers: weight_loader places each checkpoint shard at the right rows for each rank."""

import pytest
import torch

from pyorch.layers.linear import (
    SKINNY_GEMM_MAX_TOKENS,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    linear,
    use_skinny_gemm,
)
from pyorch.layers.quantization import QuantizeMethodBase
from pyorch.layers.vocab_embedding import ParallelLMHead
from tests.conftest import CUDA_AVAILABLE, DEVICES, tol


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


# ---- linear(): the skinny GEMM for decode-sized batches on CUDA, F.linear otherwise -----------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, SKINNY_GEMM_MAX_TOKENS, SKINNY_GEMM_MAX_TOKENS + 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_matches_f_linear(device: str, num_tokens: int, dtype: torch.dtype):
    # 3-D input, bias, a weight off the 16-row tile: the same result (and shape) both ways.
    x = torch.randn(1, num_tokens, 264, device=device, dtype=dtype)
    w = (torch.randn(77, 264, device=device) / 16).to(dtype)
    b = torch.randn(77, device=device, dtype=dtype)
    out = linear(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double()).to(dtype)
    assert out.shape == (1, num_tokens, 77)
    torch.testing.assert_close(out, want, **tol(dtype))
    layer = ReplicatedLinear(264, 77, bias=True, params_dtype=dtype).to(device)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)  # type: ignore[union-attr]
    torch.testing.assert_close(layer(x), out, **tol(dtype))


def test_use_skinny_gemm_only_on_cuda():
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert not use_skinny_gemm(x, w, None)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_use_skinny_gemm_by_shape():
    def make(m: int, k: int = 4096, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(m, k, device="cuda", dtype=dtype)

    w = make(4096)
    assert use_skinny_gemm(make(1), w, None)
    assert use_skinny_gemm(make(SKINNY_GEMM_MAX_TOKENS), w, w[0])
    assert not use_skinny_gemm(make(SKINNY_GEMM_MAX_TOKENS + 1), w, None)  # cuBLAS's shapes
    assert not use_skinny_gemm(make(1, dtype=torch.float32), w.float(), None)
    assert not use_skinny_gemm(make(2, 4100)[:, :4092], make(1, 4092), None)  # K % 8 != 0
    assert not use_skinny_gemm(make(2, 4104)[:, 1:4097], w, None)  # not 16-byte aligned
    assert not use_skinny_gemm(make(0), w, None)


@pytest.mark.parametrize("device", DEVICES)
def test_lm_head_logits(device: str):
    head = ParallelLMHead(1000, 128, params_dtype=torch.bfloat16).to(device)
    head.weight.data.copy_(torch.randn(1000, 128) / 12)
    hidden = torch.randn(3, 128, device=device, dtype=torch.bfloat16)
    want = (hidden.double() @ head.weight.double().T).to(torch.bfloat16).float()
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 1000)
    torch.testing.assert_close(logits, want, **tol(torch.bfloat16))
