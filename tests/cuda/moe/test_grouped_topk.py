"""grouped_topk (vLLM's DeepSeek-style router) on CPU and CUDA against the float64 reference
(tests/reference/moe.py): softmax and sigmoid scoring, with and without the score-correction
bias, renormalized or not, a routed scaling factor, DeepSeek-V3's shape, M = 0, ties, int64 ids,
and the argument checks; plus FusedMoE routing through it."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe import FusedMoE, grouped_topk
from tests.conftest import DEVICES, tol
from tests.reference import moe as ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,groups,topk_group", [
    (0, 16, 2, 4, 2), (1, 64, 6, 8, 3), (37, 256, 8, 8, 4), (5, 160, 6, 8, 3), (9, 32, 4, 1, 1),
    (11, 96, 8, 32, 5),
])
@pytest.mark.parametrize("scoring_func,with_bias,renormalize,scale", [
    ("softmax", False, True, 1.0), ("softmax", False, False, 16.0),
    ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0), ("softmax", True, True, 1.0),
])
def test_grouped_topk(device: str, dtype: torch.dtype, num_tokens: int, num_experts: int,
                      top_k: int, groups: int, topk_group: int, scoring_func: str,
                      with_bias: bool, renormalize: bool, scale: float):
    gating = (3 * torch.randn(num_tokens, num_experts + 3, device=device)).to(dtype)[:, 3:]
    bias = torch.randn(num_experts, device=device) * 0.1 if with_bias else None
    weights, ids = grouped_topk(gating, top_k, renormalize, groups, topk_group, scoring_func,
                                scale, bias)
    want_w, want_ids = ref.grouped_topk(gating, top_k, renormalize, groups, topk_group,
                                        scoring_func, scale, bias)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-6 * scale, rtol=1e-5)
    if num_tokens:  # every chosen expert lies in one of topk_group groups
        per_group = num_experts // groups
        assert max(len(set(r)) for r in (ids.cpu() // per_group).tolist()) <= topk_group


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_topk_groups_limit_the_choice_and_ties(device: str):
    # Group 1 (experts 4..7) holds the best expert, group 0 the next three: with topk_group=1 all
    # picks come from group 1, even though group 0's experts beat group 1's others.
    gating = torch.tensor([[5.0, 4.9, 4.8, 4.7, 6.0, 0.0, 0.0, 0.0]], device=device)
    weights, ids = grouped_topk(gating, 3, False, 2, 1)
    assert ids.tolist() == [[4, 5, 6]]  # ties inside the group go to the lower id
    probs = torch.softmax(gating.double().cpu(), -1)[0]
    torch.testing.assert_close(weights.cpu().double()[0], probs[[4, 5, 6]], atol=1e-6, rtol=1e-5)
    ids64 = torch.empty(1, 3, dtype=torch.int64, device=device)
    w = torch.empty(1, 3, device=device)
    _ops.grouped_topk(w, ids64, gating, 2, 2, True, "softmax", 1.0, None)
    assert ids64.tolist() == [[4, 0, 1]]
    torch.testing.assert_close(w.sum().cpu(), torch.tensor(1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_topk_checks(device: str):
    gating = torch.randn(3, 16, device=device)
    w = torch.empty(3, 4, device=device)
    ids = torch.empty(3, 4, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="num_expert_group=5 must divide"):
        _ops.grouped_topk(w, ids, gating, 5, 1, True, "softmax", 1.0, None)
    with pytest.raises(RuntimeError, match="topk_group=3 must be in"):
        _ops.grouped_topk(w, ids, gating, 2, 3, True, "softmax", 1.0, None)
    with pytest.raises(RuntimeError, match="top_k=4 must be in"):
        _ops.grouped_topk(w, ids, gating, 8, 1, True, "softmax", 1.0, None)
    with pytest.raises(RuntimeError, match="scoring_func must be 'softmax' or 'sigmoid'"):
        _ops.grouped_topk(w, ids, gating, 4, 2, True, "sqrtsoftplus", 1.0, None)
    with pytest.raises(RuntimeError, match="e_score_correction_bias must be"):
        _ops.grouped_topk(w, ids, gating, 4, 2, True, "sigmoid", 1.0,
                          torch.zeros(15, device=device))
    with pytest.raises(RuntimeError, match="topk_ids must be contiguous int32 or int64"):
        _ops.grouped_topk(w, ids.float(), gating, 4, 2, True, "softmax", 1.0, None)


def test_opcheck():
    args = (torch.empty(3, 4), torch.empty(3, 4, dtype=torch.int32), torch.randn(3, 16), 4, 2,
            True, "sigmoid", 2.0, torch.randn(16))
    torch.library.opcheck(torch.ops.pyorch.grouped_topk.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_layer_grouped_routing(device: str):
    """FusedMoE(use_grouped_topk=True, ...) routes with grouped_topk (DeepSeek-V3 style: sigmoid,
    bias, scaling) and matches the float64 chain."""
    e, top_k, h, inter, groups, topk_group = 32, 4, 64, 32, 8, 2
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    bias = torch.randn(e, device=device) * 0.05
    layer = FusedMoE(e, top_k, h, inter, renormalize=True, params_dtype=dtype,
                     use_grouped_topk=True, num_expert_group=groups, topk_group=topk_group,
                     scoring_func="sigmoid", routed_scaling_factor=2.5,
                     e_score_correction_bias=bias)
    layer.w13_weight.data.copy_(torch.randn(e, 2 * inter, h) / h**0.5)
    layer.w2_weight.data.copy_(torch.randn(e, h, inter) / inter**0.5)
    layer = layer.to(device)
    for m in (1, 40):  # the decode pair and the grouped GEMM
        x = torch.randn(m, h, device=device).to(dtype)
        logits = torch.randn(m, e, device=device)
        weights, ids = ref.grouped_topk(logits, top_k, True, groups, topk_group, "sigmoid", 2.5,
                                        bias)
        want = ref.fused_moe(x.cpu(), layer.w13_weight.cpu(), layer.w2_weight.cpu(), weights, ids)
        torch.testing.assert_close(layer(x, logits).cpu().double(), want, **tol(dtype, 8.0))


def test_fused_moe_refuses_routing_options_it_does_not_have():
    with pytest.raises(ValueError, match="need use_grouped_topk"):
        FusedMoE(8, 2, 16, 16, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="need use_grouped_topk"):
        FusedMoE(8, 2, 16, 16, routed_scaling_factor=2.0)
    with pytest.raises(ValueError, match="unsupported scoring_func 'softplus'"):
        FusedMoE(8, 2, 16, 16, use_grouped_topk=True, num_expert_group=2, topk_group=1,
                 scoring_func="softplus")
    with pytest.raises(ValueError, match="needs num_expert_group and topk_group"):
        FusedMoE(8, 2, 16, 16, use_grouped_topk=True)
    with pytest.raises(ValueError, match="must divide num_experts"):
        FusedMoE(8, 2, 16, 16, use_grouped_topk=True, num_expert_group=3, topk_group=1)
