"""fused_moe_decode (the decode MoE kernel pair: gate_up with SiLU-and-mul, then down with the
routing weights and the top-k sum) on CPU and CUDA against the float64 reference, over fresh
routings with M = 0, tokens routed to one expert twice, experts with no token, experts of another
rank, both routing block sizes; the dispatch of fused_experts on both sides of the decode range;
CUDA-graph replay with new routings; the argument checks."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe import fused_moe as fm
from pyorch.layers.fused_moe.fused_moe import fused_experts, moe_align_block_size
from tests.conftest import CUDA_AVAILABLE, capture_graph, tol
from tests.reference import moe as ref

CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA"))
    for dt in (torch.bfloat16, torch.float16)
]
# (num_tokens, num_experts, top_k, hidden, inter): Qwen3-MoE-like (many experts, I < H),
# Mixtral-like (few experts, I > H), K tails (not multiples of 128), M = 0 and M = 128.
SHAPES = [(0, 8, 2, 64, 64), (1, 8, 2, 128, 256), (1, 128, 8, 256, 96), (3, 16, 4, 200, 136),
          (8, 8, 2, 512, 1000), (32, 60, 4, 136, 520), (128, 16, 6, 64, 64)]


def _routing(num_tokens: int, num_experts: int, top_k: int, device: str) -> torch.Tensor:
    # The lower three quarters of the experts only, with replacement; token 0 picks expert 0
    # top_k times (a token routed to one expert twice).
    used = max(1, 3 * num_experts // 4)
    ids = torch.randint(0, used, (num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens:
        ids[0] = 0
    return ids


def _weights(num_experts: int, hidden: int, inter: int, device: str, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("block", [8, 16])
def test_fused_moe_decode(device: str, dtype: torch.dtype, num_tokens: int, num_experts: int,
                          top_k: int, hidden: int, inter: int, block: int):
    ids = _routing(num_tokens, num_experts, top_k, device)
    # A strided input (a column window of a wider buffer).
    x = torch.randn(num_tokens, hidden + 8, device=device).to(dtype)[:, 8:]
    w13, w2 = _weights(num_experts, hidden, inter, device, dtype)
    weights = torch.rand(num_tokens, top_k, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, block, num_experts)
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    act = torch.full((num_tokens * top_k, inter), float("nan"), dtype=dtype, device=device)
    _ops.fused_moe_decode(out, act, x, w13, w2, weights, sorted_ids, expert_ids, num_post_pad,
                          block)
    want_act = ref.expert_gemm(x, w13, None, ids, top_k, silu_and_mul=True)
    torch.testing.assert_close(act.cpu().double(), want_act, **tol(dtype, 2.0))
    # The reference's down GEMM from the kernel's own (rounded) act: out is one fp32 sum.
    down = ref.expert_gemm(act, w2, weights, ids.reshape(-1, 1), 1, silu_and_mul=False)
    want = down.view(num_tokens, top_k, hidden).sum(1)
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 2.0))
    # And the whole against the float64 chain (act rounded once more: a few ulps).
    torch.testing.assert_close(out.cpu().double(), ref.fused_moe(x, w13, w2, weights, ids),
                               **tol(dtype, 4.0))


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_moe_decode_other_ranks_experts_add_nothing(device: str, dtype: torch.dtype):
    num_experts, top_k, hidden, inter, m = 12, 3, 64, 72, 9
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[6:] = torch.arange(6, dtype=torch.int32)  # rank 1 of 2 holds experts 6..11
    ids = torch.randint(0, num_experts, (m, top_k), dtype=torch.int32, device=device)
    ids[0] = torch.tensor([0, 1, 2])  # token 0: only the other rank's experts -> zeros
    x = torch.randn(m, hidden, device=device).to(dtype)
    w13, w2 = _weights(6, hidden, inter, device, dtype)
    weights = torch.rand(m, top_k, device=device)
    out = fm.fused_experts_decode(x, w13, w2, weights, ids, num_experts, expert_map.to(device))
    # The reference: pairs of remote experts weigh zero.
    local_w = torch.where(ids.cpu() >= 6, weights.cpu(), torch.zeros(()))
    local_ids = torch.where(ids.cpu() >= 6, ids.cpu() - 6, torch.zeros((), dtype=ids.dtype))
    want = ref.fused_moe(x.cpu(), w13.cpu(), w2.cpu(), local_w, local_ids)
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 4.0))
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_experts_dispatch_by_batch_size(device: str, dtype: torch.dtype, monkeypatch):
    """fused_experts takes the decode pair while the batch is in its range (at most
    MOE_DECODE_MAX_TOKENS tokens, at most MOE_DECODE_MAX_PAIRS_PER_EXPERT pairs per expert on
    average) and the grouped GEMMs past it; both agree with the reference on either side."""
    num_experts, top_k, hidden, inter = 16, 4, 128, 64
    w13, w2 = _weights(num_experts, hidden, inter, device, dtype)
    calls: list[int] = []
    real = fm.fused_experts_decode

    def counted(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fm, "fused_experts_decode", counted)
    limit = fm.MOE_DECODE_MAX_PAIRS_PER_EXPERT * num_experts // top_k  # 32 tokens here
    for m in (1, limit, limit + 1):
        x = torch.randn(m, hidden, device=device).to(dtype)
        ids = _routing(m, num_experts, top_k, device)
        weights = torch.rand(m, top_k, device=device)
        out = fused_experts(x, w13, w2, weights, ids, num_experts)
        torch.testing.assert_close(out.cpu().double(), ref.fused_moe(x, w13, w2, weights, ids),
                                   **tol(dtype, 4.0))
    assert calls == [1, limit]
    assert fm.moe_decode_block_size(1, 8, 128) == 8 and fm.moe_decode_block_size(32, 8, 128) == 16
    assert fm.moe_decode_block_size(128, 8, 128) == 16  # Qwen3-30B-A3B: up to 128 tokens
    assert fm.moe_decode_block_size(129, 8, 128) is None
    assert fm.moe_decode_block_size(32, 2, 8) == 16  # Mixtral: up to 32
    assert fm.moe_decode_block_size(33, 2, 8) is None


@pytest.mark.parametrize("device,dtype", CASES)
def test_single_token_routing_skips_the_sort(device: str, dtype: torch.dtype, monkeypatch):
    """One token (batch-1 decode) is routed one pair per block, without moe_align_block_size:
    the same result as the sorted routing, with a token routed to one expert twice, with other
    ranks' experts (expert_map), and the sort again for int64 ids and for several tokens."""
    num_experts, top_k, hidden, inter = 24, 6, 136, 72
    w13, w2 = _weights(num_experts, hidden, inter, device, dtype)
    sorts: list[int] = []
    real = fm.moe_align_block_size

    def counted(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        sorts.append(ids.shape[0])
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(fm, "moe_align_block_size", counted)
    for trial in range(3):
        x = torch.randn(1, hidden, device=device).to(dtype)
        ids = torch.randperm(num_experts, device=device)[:top_k].to(torch.int32).view(1, top_k)
        if trial == 1:
            ids[0, 3] = ids[0, 1]  # one expert twice
        weights = torch.rand(1, top_k, device=device)
        out = fm.fused_experts_decode(x, w13, w2, weights, ids, num_experts)
        torch.testing.assert_close(out.cpu().double(), ref.fused_moe(x, w13, w2, weights, ids),
                                   **tol(dtype, 4.0))
        sorted_out = fm.fused_experts_decode(x, w13, w2, weights, ids.long(), num_experts)
        # The same pairs summed in another order (pair order here, expert order there).
        torch.testing.assert_close(out, sorted_out, **tol(dtype, 1.0))
    assert sorts == [1, 1, 1]  # only the int64 calls sorted
    # Expert parallelism: this rank holds experts 12..23 as local 0..11.
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[12:] = torch.arange(12, dtype=torch.int32)
    ids = torch.tensor([[0, 13, 5, 23, 12, 7]], dtype=torch.int32, device=device)
    x = torch.randn(1, hidden, device=device).to(dtype)
    weights = torch.rand(1, top_k, device=device)
    local13, local2 = w13[12:].contiguous(), w2[12:].contiguous()
    out = fm.fused_experts_decode(x, local13, local2, weights, ids, num_experts,
                                  expert_map.to(device))
    mine = ids.cpu() >= 12
    want = ref.fused_moe(x.cpu(), local13.cpu(), local2.cpu(),
                         torch.where(mine, weights.cpu(), torch.zeros(())),
                         torch.where(mine, ids.cpu() - 12, torch.zeros((), dtype=ids.dtype)))
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 4.0))
    assert sorts == [1, 1, 1]
    two = torch.randint(0, num_experts, (2, top_k), dtype=torch.int32, device=device)
    fm.fused_experts_decode(torch.randn(2, hidden, device=device).to(dtype), w13, w2,
                            torch.rand(2, top_k, device=device), two, num_experts)
    assert sorts == [1, 1, 1, 2]


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_fused_moe_decode_cuda_graph(num_tokens: int):
    """Captured once, replayed with new routings and inputs: nothing is read on the host."""
    num_experts, top_k, hidden, inter = 32, 4, 256, 128
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(num_tokens, hidden, device=dev).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dev, dtype)
    ids = _routing(num_tokens, num_experts, top_k, dev)
    weights = torch.rand(num_tokens, top_k, device=dev)
    result: list[torch.Tensor] = []
    graph = capture_graph(lambda: result.append(
        fm.fused_experts_decode(x, w13, w2, weights, ids, num_experts)))
    for _ in range(3):
        ids.copy_(torch.randint(0, num_experts, ids.shape, dtype=torch.int32, device=dev))
        x.copy_(torch.randn_like(x))
        weights.copy_(torch.rand_like(weights))
        graph.replay()
        torch.testing.assert_close(result[-1].cpu().double(),
                                   ref.fused_moe(x, w13, w2, weights, ids), **tol(dtype, 4.0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA_AVAILABLE, reason="no CUDA"))])
def test_fused_moe_decode_checks(device: str):
    dtype = torch.bfloat16
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 8, 4)
    x = torch.randn(4, 64, device=device, dtype=dtype)
    w13, w2 = _weights(4, 64, 32, device, dtype)

    def call(**kw) -> None:  # type: ignore[no-untyped-def]
        args = dict(out=torch.empty(4, 64, device=device, dtype=dtype),
                    act=torch.empty(8, 32, device=device, dtype=dtype), hidden_states=x, w13=w13,
                    w2=w2, topk_weights=torch.rand(4, 2, device=device),
                    sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                    num_tokens_post_padded=num_post_pad, block_size=8)
        args.update(kw)
        _ops.fused_moe_decode(**args)

    call()  # the valid call
    with pytest.raises(RuntimeError, match="act must be"):
        call(act=torch.empty(4, 32, device=device, dtype=dtype))
    with pytest.raises(RuntimeError, match="do not fit hidden size"):
        call(w2=w2[:, :32])
    with pytest.raises(RuntimeError, match="topk_weights must be contiguous float32"):
        call(topk_weights=torch.rand(4, 2, device=device, dtype=dtype))
    with pytest.raises(RuntimeError, match="one entry per block"):
        call(expert_ids=expert_ids[:-1])
    if device == "cuda":
        with pytest.raises(RuntimeError, match="block_size must be 8 or 16"):
            call(block_size=4, expert_ids=torch.empty(-(-sorted_ids.numel() // 4),
                                                      dtype=torch.int32, device=device))
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            call(out=torch.empty(4, 64, device=device), act=torch.empty(8, 32, device=device),
                 hidden_states=x.float(), w13=w13.float(), w2=w2.float())


def test_opcheck():
    ids = torch.randint(0, 4, (5, 2), dtype=torch.int32)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 8, 4)
    w13, w2 = _weights(4, 64, 32, "cpu", torch.float32)
    args = (torch.empty(5, 64), torch.empty(10, 32), torch.randn(5, 64), w13, w2,
            torch.rand(5, 2), sorted_ids, expert_ids, num_post_pad, 8, None)
    torch.library.opcheck(torch.ops.pyorch.fused_moe_decode.default, args)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_fused_moe_decode_is_deterministic_with_and_without_pdl():
    """The down kernel's top-k sum has a fixed order (no atomics): repeated calls, with PDL and
    without, give the same bits; each call's input is the previous kernel's output, so a kernel
    that read before its pdl_wait would show."""
    num_experts, top_k, hidden, inter, m = 64, 6, 512, 256, 9
    w13, w2 = _weights(num_experts, hidden, inter, "cuda", torch.bfloat16)
    ids = _routing(m, num_experts, top_k, "cuda")
    weights = torch.rand(m, top_k, device="cuda")
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 8, num_experts)
    x0 = torch.randn(m, hidden, device="cuda").to(torch.bfloat16)
    results = []
    for pdl in (True, False, True):
        x = x0 * 1.0  # a fresh kernel writes the input right before the decode pair
        out = torch.empty(m, hidden, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(m * top_k, inter, device="cuda", dtype=torch.bfloat16)
        _ops.fused_moe_decode(out, act, x, w13, w2, weights, sorted_ids, expert_ids,
                              num_post_pad, 8, pdl)
        results.append((out.clone(), act.clone()))
    for out, act in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(act, results[0][1])


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter",
                         [(1, 128, 8, 2048, 768), (2, 128, 8, 2048, 768), (1, 64, 6, 512, 520),
                          (1, 8, 2, 512, 1000)])
def test_legacy_picks_compute_the_same_product(num_tokens: int, num_experts: int, top_k: int,
                                               hidden: int, inter: int):
    """PYORCH_MOE_DECODE_LEGACY_PICKS (the A/B switch) changes only the launch: gate_up's resident
    CTAs per SM (its register cap) and the down kernel's L2 prefetch, not the order of any sum.
    The shapes include Qwen3-30B-A3B's at one token, where the default takes 8 CTAs per SM."""
    from pyorch import _C

    assert not _C.moe_decode_legacy_picks()
    ids = _routing(num_tokens, num_experts, top_k, "cuda")
    x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
    w13, w2 = _weights(num_experts, hidden, inter, "cuda", torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, device="cuda")
    results = []
    for legacy in (False, True):
        _C.set_moe_decode_legacy_picks(legacy)
        try:
            results.append(fm.fused_experts_decode(x, w13, w2, weights, ids, num_experts))
        finally:
            _C.set_moe_decode_legacy_picks(False)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0].cpu().double(), ref.fused_moe(x, w13, w2, weights, ids),
                               **tol(torch.bfloat16, 4.0))
