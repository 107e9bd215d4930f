"""topk_softmax, moe_align_block_size and moe_sum on CPU and CUDA against float64 references
(tests/reference/moe.py): fresh random data, M = 0, tokens routed to one expert twice, experts
that get no token, an expert map (expert parallelism) and the argument checks."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe.fused_moe import moe_align_block_size
from tests.conftest import CUDA_AVAILABLE, DEVICES, tol
from tests.reference import moe as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (0, 8, 2), (1, 8, 2), (7, 60, 4), (83, 128, 8), (989, 7, 3), (33, 257, 8), (5, 1024, 32),
])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(device: str, dtype: torch.dtype, num_tokens: int, num_experts: int,
                      top_k: int, renormalize: bool):
    # A strided view of a wider buffer; 3x spread gives both flat and peaked distributions.
    gating = (3 * torch.randn(num_tokens, num_experts + 5, device=device)).to(dtype)
    gating = gating[:, 2:num_experts + 2]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    token_expert = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    _ops.topk_softmax(weights, ids, token_expert, gating, renormalize)
    want_w, want_ids = ref.topk_softmax(gating.cpu(), top_k, renormalize)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-6, rtol=1e-5)
    want_te = torch.arange(top_k).view(1, -1) * num_tokens + torch.arange(num_tokens).view(-1, 1)
    assert torch.equal(token_expert.cpu().long(), want_te)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_topk_softmax_waits_for_the_router_gemm():
    """topk_softmax launches with PDL: it may start while the router GEMM before it runs and must
    read its logits only after the wait. A skinny GEMM (itself PDL-launched) writes new logits
    right before each call, into the same buffer; each call's choice matches them."""
    torch.manual_seed(0)
    hidden, num_experts, top_k = 2048, 128, 8
    gate = (torch.randn(num_experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    logits = torch.empty(1, num_experts, device="cuda", dtype=torch.bfloat16)
    weights = torch.empty(1, top_k, device="cuda")
    ids = torch.empty(1, top_k, dtype=torch.int32, device="cuda")
    token_expert = torch.empty(1, top_k, dtype=torch.int32, device="cuda")
    for _ in range(20):
        x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
        _ops.skinny_gemm(logits, x, gate, None)
        _ops.topk_softmax(weights, ids, token_expert, logits, True)
        want_w, want_ids = ref.topk_softmax(logits.cpu(), top_k, True)
        assert torch.equal(ids.cpu().long(), want_ids)
        torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_softmax_ties_and_int64(device: str):
    # Equal logits: the lower expert id wins each round, on every backend.
    gating = torch.zeros(3, 40, device=device)
    gating[1, 7] = gating[1, 30] = 1.0
    weights = torch.empty(3, 3, device=device)
    ids = torch.empty(3, 3, dtype=torch.int64, device=device)
    _ops.topk_softmax(weights, ids, torch.empty(3, 3, dtype=torch.int32, device=device), gating,
                      True)
    assert ids.tolist() == [[0, 1, 2], [7, 30, 0], [0, 1, 2]]
    torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_softmax_16_bit_ties_signed_zeros_and_negatives(device: str, dtype: torch.dtype):
    # 16-bit logits take the packed-key argmax on CUDA: equal values (the two zeros included)
    # go to the lower expert id, negatives order below positives, -inf last.
    gating = torch.full((3, 70), -3.0, device=device)
    gating[0, 3], gating[0, 1] = -0.0, 0.0  # equal: 1 before 3, both above the -3s
    gating[0, 40] = -2.5
    gating[1, 65], gating[1, 64], gating[1, 2] = -0.5, -0.5, -float("inf")
    gating[2] = torch.linspace(-4, 4, 70, device=device)
    gating = gating.to(dtype)
    weights = torch.empty(3, 5, device=device)
    ids = torch.empty(3, 5, dtype=torch.int32, device=device)
    _ops.topk_softmax(weights, ids, torch.empty(3, 5, dtype=torch.int32, device=device), gating,
                      False)
    assert ids[0, :3].tolist() == [1, 3, 40]
    assert ids[1, :3].tolist() == [64, 65, 0]
    assert ids[2].tolist() == [69, 68, 67, 66, 65]
    want_w, want_ids = ref.topk_softmax(gating.cpu(), 5, False)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_softmax_checks(device: str):
    gating = torch.randn(4, 8, device=device)
    w = torch.empty(4, 2, device=device)
    ids = torch.empty(4, 2, dtype=torch.int32, device=device)
    te = torch.empty(4, 2, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        _ops.topk_softmax(torch.empty(4, 9, device=device),
                          torch.empty(4, 9, dtype=torch.int32, device=device),
                          torch.empty(4, 9, dtype=torch.int32, device=device), gating, False)
    with pytest.raises(RuntimeError, match="topk_indices must be int32 or int64"):
        _ops.topk_softmax(w, ids.float(), te, gating, False)
    with pytest.raises(RuntimeError, match="must all be"):
        _ops.topk_softmax(w, ids[:3], te, gating, False)


def _check_alignment(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                     sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_pad: torch.Tensor,
                     expert_map: torch.Tensor | None = None) -> None:
    flat = topk_ids.reshape(-1).long().cpu()
    num_flat = flat.numel()
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    total = int(padded.sum())
    assert int(num_post_pad.item()) == total
    start = 0
    for e in range(num_experts):
        run = sorted_ids[start:start + int(padded[e])]
        real = run[run < num_flat]
        # Exactly this expert's pairs (a token routed to it twice appears twice), then padding.
        assert sorted(real.tolist()) == torch.nonzero(flat == e).flatten().tolist()
        assert torch.all(run[len(real):] == num_flat)
        want = int(expert_map[e]) if expert_map is not None else e
        assert torch.all(expert_ids[start // block_size:(start + int(padded[e])) // block_size]
                         == want)
        start += int(padded[e])
    assert torch.all(sorted_ids[total:] == num_flat)
    assert torch.all(expert_ids[total // block_size:] == -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 64, 7])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (0, 8, 2), (1, 8, 2), (1, 128, 8), (83, 5, 3), (300, 128, 8), (4096, 60, 4), (7, 1024, 2),
])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_align_block_size(device: str, block_size: int, num_tokens: int, num_experts: int,
                              top_k: int, ids_dtype: torch.dtype):
    # Experts drawn from the lower half only: the upper half gets no token. Ids are drawn with
    # replacement, so some tokens pick one expert twice.
    used = max(1, num_experts // 2)
    topk_ids = torch.randint(0, used, (num_tokens, top_k), dtype=ids_dtype, device=device)
    if num_tokens:
        topk_ids[0] = topk_ids[0, 0]  # token 0 routes to the same expert top_k times
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block_size, num_experts)
    _check_alignment(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post_pad)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_align_block_size_expert_map(device: str):
    num_experts, block_size = 12, 16
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[4:8] = torch.arange(4, dtype=torch.int32)  # rank 1 of 3
    topk_ids = torch.randint(0, num_experts, (50, 4), dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(
        topk_ids, block_size, num_experts, expert_map.to(device))
    _check_alignment(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post_pad,
                     expert_map)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_align_block_size_checks(device: str):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    small = torch.empty(3, dtype=torch.int32, device=device)
    blocks = torch.empty(8, dtype=torch.int32, device=device)
    one = torch.empty(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="sorted_token_ids needs at least"):
        _ops.moe_align_block_size(ids, 4, 16, small, blocks, one)
    with pytest.raises(RuntimeError, match="must be contiguous int32 or int64"):
        _ops.moe_align_block_size(ids.float(), 4, 16, small, blocks, one)
    with pytest.raises(RuntimeError, match="expert_map must be"):
        _ops.moe_align_block_size(ids, 4, 1, torch.empty(8, dtype=torch.int32, device=device),
                                  blocks, one, torch.zeros(3, dtype=torch.int32, device=device))


def test_moe_align_block_size_rejects_bad_ids_on_cpu():
    ids = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="expert id 9 out of range"):
        moe_align_block_size(ids, 16, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(0, 2, 64), (1, 8, 2048), (83, 3, 769),
                                                     (989, 1, 111)])
def test_moe_sum(device: str, dtype: torch.dtype, num_tokens: int, top_k: int, hidden: int):
    x = torch.randn(num_tokens, top_k, hidden, device=device).to(dtype)
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    _ops.moe_sum(x, out)
    torch.testing.assert_close(out.cpu(), x.cpu().double().sum(1).to(dtype), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_moe_sum_checks(device: str):
    x = torch.randn(4, 2, 8, device=device)
    with pytest.raises(RuntimeError, match="moe_sum: input must be"):
        _ops.moe_sum(x, torch.empty(4, 9, device=device))
    with pytest.raises(RuntimeError, match="output dtype must match"):
        _ops.moe_sum(x, torch.empty(4, 8, device=device, dtype=torch.float16))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str):
    gating = torch.randn(5, 16, device=device)
    args = (torch.empty(5, 4, device=device), torch.empty(5, 4, dtype=torch.int32, device=device),
            torch.empty(5, 4, dtype=torch.int32, device=device), gating, True)
    torch.library.opcheck(torch.ops.pyorch.topk_softmax.default, args)
    torch.library.opcheck(torch.ops.pyorch.moe_sum.default,
                          (torch.randn(5, 4, 8, device=device), torch.empty(5, 8, device=device)))
