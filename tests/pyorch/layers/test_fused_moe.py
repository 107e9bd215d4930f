"""FusedMoE: the layer against the float64 reference, its weight loader (vLLM's w1/w2/w3 shard
ids), and the parallel seam: tensor-parallel shards of the intermediate dimension and
expert-parallel ranks each compute a partial sum, and the partial sums add up to the whole."""

import pytest
import torch

from pyorch.layers.fused_moe import FusedMoE
from pyorch.layers.fused_moe.layer import expert_placement
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
    with pytest.raises(ValueError, match="expert parallel size 9 is larger than the number of "
                                         r"experts \(8\)"):
        FusedMoE(E, TOP_K, H, INTER, ep_size=9)
    with pytest.raises(ValueError, match="expert_placement_strategy 'striped' is not supported"):
        FusedMoE(E, TOP_K, H, INTER, ep_size=2, expert_placement_strategy="striped")


@pytest.mark.parametrize("strategy, want", [
    ("linear", [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),
    ("round_robin", [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]),
])
def test_expert_placement_matches_vllm(strategy: str, want: list[list[int]]):
    """vLLM's determine_expert_map: 10 experts over 4 ranks, the first 10 % 4 ranks hold one
    more; every expert is held exactly once."""
    assert [expert_placement(10, 4, r, strategy) for r in range(4)] == want
    assert expert_placement(8, 1, 0, strategy) == list(range(8))


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_uneven_expert_parallel_ranks_sum_to_the_whole(strategy: str):
    """8 experts over 3 ranks (3, 3, 2): each rank holds whole experts at their local index in
    its expert_map, the other ranks' rows come out zero, and the partial sums add up."""
    experts = _expert_weights()
    x, logits = torch.randn(23, H), torch.randn(23, E)
    whole = _build(experts, "cpu", torch.float32)(x, logits)
    ranks = [_build(experts, "cpu", torch.float32, ep_size=3, ep_rank=r,
                    expert_placement_strategy=strategy) for r in range(3)]
    assert [layer.local_num_experts for layer in ranks] == [3, 3, 2]
    for layer in ranks:
        assert layer.intermediate_size_per_partition == INTER  # whole experts
        assert layer.expert_map is not None
        for local, e in enumerate(layer.local_expert_ids):
            assert int(layer.expert_map[e]) == local
            torch.testing.assert_close(layer.w2_weight[local], experts[e]["w2"])
        assert int((layer.expert_map >= 0).sum()) == layer.local_num_experts
    torch.testing.assert_close(sum(layer(x, logits) for layer in ranks), whole,
                               **tol(torch.float32))


def test_other_ranks_experts_are_never_read():
    """The loader skips another rank's expert before touching its tensor: a meta tensor (no
    data; any read or copy raises) passes, so a memory-mapped checkpoint's pages of those
    experts are never read."""
    layer = FusedMoE(E, TOP_K, H, INTER, ep_size=4, ep_rank=1)  # holds experts 2 and 3
    for e in range(E):
        for shard in ("w1", "w2", "w3"):
            shape = (H, INTER) if shard == "w2" else (INTER, H)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            if layer.local_expert(e) is None:
                layer.weight_loader(param, torch.empty(shape, device="meta"), "x", shard, e)
            else:
                with pytest.raises((NotImplementedError, RuntimeError)):
                    layer.weight_loader(param, torch.empty(shape, device="meta"), "x", shard, e)
