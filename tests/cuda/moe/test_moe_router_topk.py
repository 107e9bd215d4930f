"""moe_router_topk: the router GEMM and topk_softmax in one launch (a decode batch on CUDA).

The logits against the float64 product rounded to the dtype; the top-k against topk_softmax run
on the op's own logits (the same routing, bit for bit) and against the float64 softmax's order;
the counter workspace left at 0 for the next call and a CUDA graph's replays; strided rows; the
cases the CUDA kernel does not take, which must raise."""

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_experts, hidden, top_k): Mixtral's routing, Qwen3-30B-A3B's, odd sizes, the most experts
SHAPES = [(8, 4096, 2), (128, 2048, 8), (60, 520, 4), (1024, 256, 32)]


def _inputs(m, e, h, dtype, device, pad=8):
    wide = torch.randn(m, h + pad, device=device).to(dtype)
    x = wide[:, :h]  # strided rows, as a slice of a wider activation
    w = (torch.randn(e, h, device=device) / h**0.5).to(dtype)
    return x, w


def _call(x, w, top_k, renormalize, counter=None):
    m, e = x.shape[0], w.shape[0]
    weights = torch.empty(m, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(m, e, dtype=x.dtype, device=x.device)
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    _ops.moe_router_topk(weights, ids, logits, x, w, counter, renormalize)
    return weights, ids, logits, counter


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts,hidden,top_k", SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_router_gemm_then_topk_softmax(device, dtype, num_experts, hidden, top_k,
                                               num_tokens, renormalize):
    x, w = _inputs(num_tokens, num_experts, hidden, dtype, device)
    weights, ids, logits, counter = _call(x, w, top_k, renormalize)
    assert counter.item() == 0, "the counter must be left at 0 for the next launch"

    want_logits = (x.double() @ w.double().T).to(dtype)
    torch.testing.assert_close(logits, want_logits, **tol(dtype, 2))

    # The routing of the op's own logits is topk_softmax's, exactly.
    ref_w = torch.empty_like(weights)
    ref_ids = torch.empty_like(ids)
    te = torch.empty_like(ids)
    _ops.topk_softmax(ref_w, ref_ids, te, logits, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)

    # And it is the top_k of the float64 softmax of those logits, with its weights.
    probs = torch.softmax(logits.double(), dim=-1)
    chosen = probs.gather(1, ids.long())
    kth = probs.topk(top_k, dim=-1).values[:, -1:]
    assert bool((chosen >= kth).all()), "a chosen expert is not among the top_k"
    want_w = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_share_one_counter(device):
    """Many launches on one counter (as every MoE layer of a model shares one per device)."""
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(5):
        x, w = _inputs(2, 128, 2048, torch.bfloat16, device)
        weights, ids, logits, counter = _call(x, w, 8, True, counter)
        ref_w, ref_ids, te = torch.empty_like(weights), torch.empty_like(ids), torch.empty_like(ids)
        _ops.topk_softmax(ref_w, ref_ids, te, logits, True)
        assert torch.equal(ids, ref_ids)
    assert counter.item() == 0


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_cuda_graph_replay():
    x, w = _inputs(1, 128, 2048, torch.bfloat16, "cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    weights = torch.empty(1, 8, dtype=torch.float32, device="cuda")
    ids = torch.empty(1, 8, dtype=torch.int32, device="cuda")
    logits = torch.empty(1, 128, dtype=torch.bfloat16, device="cuda")
    graph = capture_graph(
        lambda: _ops.moe_router_topk(weights, ids, logits, x, w, counter, True))
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids, want_logits, _ = _call(x, w, 8, True)
        assert torch.equal(logits, want_logits) and torch.equal(ids, want_ids)
        assert torch.equal(weights, want_w)
        assert counter.item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_arguments(device):
    x, w = _inputs(2, 16, 64, torch.bfloat16, device)
    with pytest.raises(RuntimeError, match="gate_weight must be a contiguous"):
        _call(x, w.float(), 2, True)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        x12, w12 = _inputs(2, 16, 12, torch.bfloat16, device, pad=0)
        _call(x12, w12, 2, True)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        _call(x, w, 17, True)
    with pytest.raises(RuntimeError, match="int32"):
        weights = torch.empty(2, 2, dtype=torch.float32, device=device)
        ids = torch.empty(2, 2, dtype=torch.int64, device=device)
        logits = torch.empty(2, 16, dtype=torch.bfloat16, device=device)
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        _ops.moe_router_topk(weights, ids, logits, x, w, counter, True)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_cuda_rejects_more_than_eight_tokens():
    x, w = _inputs(9, 16, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="up to 8 tokens"):
        _call(x, w, 2, True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w = _inputs(3, 16, 64, torch.bfloat16, device)
    args = (torch.empty(3, 2, dtype=torch.float32, device=device),
            torch.empty(3, 2, dtype=torch.int32, device=device),
            torch.empty(3, 16, dtype=torch.bfloat16, device=device), x, w,
            torch.zeros(1, dtype=torch.int32, device=device), True)
    torch.library.opcheck(torch.ops.pyorch.moe_router_topk.default, args)
