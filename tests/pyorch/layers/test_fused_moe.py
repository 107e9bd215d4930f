"""FusedMoE: the layer against the float64 reference, its weight loader (vLLM's w1/w2/w3 shard
ids), and the parallel seam: tensor-parallel shards of the intermediate dimension and
expert-parallel ranks each compute a partial sum, and the partial sums add up to the whole."""

import pytest
import torch

from pyorch.layers.fused_moe import FusedMoE
from tests.conftest import DEVICES, tol
from tests.reference import moe as ref

E, TOP_K, H, INTER = 8, 3, 64, 48


def _expert_weights() -> list[dict[str, torch.Tensor]]:
    return [{"w1": torch.randn(INTER, H) / H**0.5, "w3": torch.randn(INTER, H) / H**0.5,
             "w2": torch.randn(H, INTER) / INTER**0.5} for _ in range(E)]


def _build(experts: list[dict[str, torch.Tensor]], device: str, dtype: torch.dtype,
           **parallel: int) -> FusedMoE:
    layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True, params_dtype=dtype, **parallel)
    for e, mats in enumerate(experts):
        for shard, w in mats.items():
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, w, f"experts.{e}.{shard}", shard, e)
    return layer.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_fused_moe_layer(device: str, num_tokens: int):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    experts = _expert_weights()
    layer = _build(experts, device, dtype)
    x = torch.randn(num_tokens, H, device=device).to(dtype)
    logits = torch.randn(num_tokens, E, device=device)
    out = layer(x, logits)
    weights, ids = ref.topk_softmax(logits.cpu(), TOP_K, renormalize=True)
    w13 = torch.stack([torch.cat([m["w1"], m["w3"]]) for m in experts]).to(dtype)
    w2 = torch.stack([m["w2"] for m in experts]).to(dtype)
    want = ref.fused_moe(x.cpu(), w13, w2, weights, ids)
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 4.0))


def test_tensor_and_expert_parallel_shards_sum_to_the_whole():
    experts = _expert_weights()
    x, logits = torch.randn(29, H), torch.randn(29, E)
    whole = _build(experts, "cpu", torch.float32)(x, logits)
    tp = [_build(experts, "cpu", torch.float32, tp_size=3, tp_rank=r) for r in range(3)]
    assert tp[0].w13_weight.shape == (E, 2 * INTER // 3, H)
    assert tp[0].w2_weight.shape == (E, H, INTER // 3)
    torch.testing.assert_close(sum(layer(x, logits) for layer in tp), whole, **tol(torch.float32))
    ep = [_build(experts, "cpu", torch.float32, ep_size=4, ep_rank=r) for r in range(4)]
    assert ep[1].w13_weight.shape == (E // 4, 2 * INTER, H)
    assert ep[1].expert_map is not None and ep[1].expert_map.tolist() == [-1, -1, 0, 1] + [-1] * 4
    torch.testing.assert_close(sum(layer(x, logits) for layer in ep), whole, **tol(torch.float32))


def test_weight_loader_and_constructor_checks():
    layer = FusedMoE(E, TOP_K, H, INTER)
    with pytest.raises(ValueError, match="shard_id must be w1, w2 or w3"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER, H), "x", "w4", 0)
    with pytest.raises(ValueError, match="intermediate size 40, expected 48"):
        layer.weight_loader(layer.w13_weight, torch.zeros(40, H), "x", "w1", 0)
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H + 1, INTER), "x", "w2", 0)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        FusedMoE(E, 9, H, INTER)
    with pytest.raises(ValueError, match="must divide by tp_size"):
        FusedMoE(E, TOP_K, H, INTER, tp_size=5)
