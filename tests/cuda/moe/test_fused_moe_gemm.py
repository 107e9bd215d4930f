"""fused_moe_gemm (the grouped expert GEMM) on CPU and CUDA against the float64 reference, both
as the gate_up GEMM (SiLU-and-mul fused) and as the down GEMM (routing weights in the
epilogue), over fresh routings with M = 0, a token routed to one expert twice, experts with no
token and experts of another rank; plus the whole fused_experts path and the argument checks."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe.fused_moe import fused_experts, moe_align_block_size
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol
from tests.reference import moe as ref

# (dtype, devices): the CUDA kernel is tensor-core only (fp16/bf16).
CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA"))
    for dt in (torch.bfloat16, torch.float16)
]
# (num_tokens, num_experts, top_k, N, K): awkward sizes, decode and prefill shapes.
SHAPES = [(0, 8, 2, 64, 64), (1, 8, 2, 96, 128), (1, 128, 8, 384, 256), (7, 16, 4, 200, 136),
          (83, 60, 4, 128, 520), (300, 8, 2, 1000, 64), (1024, 16, 2, 256, 256),
          (164, 8, 3, 128, 128), (164, 8, 3, 128, 64)]  # the tiny Qwen3-MoE's prefill (top-3)


def _routing(num_tokens: int, num_experts: int, top_k: int, device: str) -> torch.Tensor:
    # Ids from the lower three quarters only (the rest get no token), with replacement (a token
    # may pick one expert twice); token 0 picks expert 0 top_k times.
    used = max(1, 3 * num_experts // 4)
    ids = torch.randint(0, used, (num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens:
        ids[0] = 0
    return ids


def _block_sizes(device: str, num_flat: int, num_experts: int) -> list[int]:
    return [16, 64] if device == "cuda" else [16, 64, 5]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,n,k", SHAPES)
@pytest.mark.parametrize("silu_and_mul", [True, False])
def test_fused_moe_gemm(device: str, dtype: torch.dtype, num_tokens: int, num_experts: int,
                        top_k: int, n: int, k: int, silu_and_mul: bool):
    ids = _routing(num_tokens, num_experts, top_k, device)
    num_flat = num_tokens * top_k
    # gate_up reads token rows (row f / top_k); down reads one row per pair (top_k = 1 there).
    rows, a_top_k = (num_tokens, top_k) if silu_and_mul else (num_flat, 1)
    pair_ids = ids if silu_and_mul else ids.reshape(-1, 1)  # the reference's [rows, a_top_k]
    # A strided input (a column window of a wider buffer), weights scaled for O(1) outputs.
    x = torch.randn(rows, k + 8, device=device).to(dtype)[:, 8:]
    w = (torch.randn(num_experts, n, k, device=device) / k**0.5).to(dtype)
    weights = None if silu_and_mul else torch.rand(num_flat, device=device)
    want = ref.expert_gemm(x, w, weights, pair_ids, a_top_k, silu_and_mul)
    for block in _block_sizes(device, num_flat, num_experts):
        sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, block, num_experts)
        out = torch.full((num_flat, n // 2 if silu_and_mul else n), float("nan"), dtype=dtype,
                         device=device)
        _ops.fused_moe_gemm(out, x, w, weights, sorted_ids, expert_ids, num_post_pad, a_top_k,
                            block, silu_and_mul)
        torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 2.0),
                                   msg=f"block_size {block}")


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_moe_gemm_other_ranks_experts_write_zeros(device: str, dtype: torch.dtype):
    num_experts, top_k, n, k = 12, 3, 64, 64
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[6:] = torch.arange(6, dtype=torch.int32)  # rank 1 of 2 holds experts 6..11
    ids = torch.randint(0, num_experts, (40, top_k), dtype=torch.int32, device=device)
    x = torch.randn(40, k, device=device).to(dtype)
    w_local = (torch.randn(6, n, k, device=device) / k**0.5).to(dtype)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 16, num_experts,
                                                                expert_map.to(device))
    out = torch.full((40 * top_k, n // 2), float("nan"), dtype=dtype, device=device)
    _ops.fused_moe_gemm(out, x, w_local, None, sorted_ids, expert_ids, num_post_pad, top_k, 16,
                        True)
    want = ref.expert_gemm(x, w_local, None, ids, top_k, True, expert_map)
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 2.0))
    assert torch.all(out[(ids.reshape(-1) < 6).nonzero().flatten()] == 0)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 200])
def test_fused_experts(device: str, dtype: torch.dtype, num_tokens: int):
    """The whole MoE computation: route, sort, two grouped GEMMs, sum."""
    num_experts, top_k, hidden, inter = 16, 4, 256, 136
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    ids = _routing(num_tokens, num_experts, top_k, device)
    weights = torch.softmax(torch.randn(num_tokens, top_k, device=device), -1)
    out = fused_experts(x, w13, w2, weights, ids, num_experts)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    want = ref.fused_moe(x, w13, w2, weights, ids)
    # The intermediate activation is rounded to dtype between the GEMMs: a few ulps more.
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 4.0))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_fused_experts_cuda_graph():
    """Captured once, replayed with new routings: nothing is read on the host."""
    num_experts, top_k, hidden, inter, num_tokens = 16, 2, 128, 64, 9
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(num_tokens, hidden, device=dev).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=dev) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=dev) / inter**0.5).to(dtype)
    ids = _routing(num_tokens, num_experts, top_k, dev)
    weights = torch.rand(num_tokens, top_k, device=dev)
    result: list[torch.Tensor] = []
    graph = capture_graph(lambda: result.append(fused_experts(x, w13, w2, weights, ids,
                                                              num_experts)))
    for _ in range(3):
        ids.copy_(torch.randint(0, num_experts, ids.shape, dtype=torch.int32, device=dev))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(result[-1].cpu().double(),
                                   ref.fused_moe(x, w13, w2, weights, ids), **tol(dtype, 4.0))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_gemm_checks(device: str):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 16, 4)
    dtype = torch.bfloat16
    x = torch.randn(4, 64, device=device, dtype=dtype)
    w = torch.randn(4, 32, 64, device=device, dtype=dtype)
    out = torch.empty(8, 16, device=device, dtype=dtype)

    def call(**kw) -> None:  # type: ignore[no-untyped-def]
        args = dict(out=out, input=x, weight=w, topk_weights=None, sorted_token_ids=sorted_ids,
                    expert_ids=expert_ids, num_tokens_post_padded=num_post_pad, top_k=2,
                    block_size=16, silu_and_mul=True)
        args.update(kw)
        _ops.fused_moe_gemm(**args)

    call()  # the valid call
    with pytest.raises(RuntimeError, match="out needs 32 columns"):
        call(silu_and_mul=False)
    with pytest.raises(RuntimeError, match="input has 63 columns"):
        call(input=x[:, :63])
    with pytest.raises(RuntimeError, match="too few for 8 output rows"):
        call(top_k=1)
    with pytest.raises(RuntimeError, match="topk_weights must be contiguous float32"):
        call(topk_weights=torch.ones(3, device=device))
    with pytest.raises(RuntimeError, match="one entry per block"):
        call(expert_ids=expert_ids[:-1])
    if device == "cuda":
        with pytest.raises(RuntimeError, match="block_size must be 16 or 64"):
            call(block_size=32, expert_ids=torch.empty(-(-sorted_ids.numel() // 32),
                                                       dtype=torch.int32, device=device))
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            call(out=out.float(), input=x.float(), weight=w.float())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids = torch.randint(0, 4, (5, 2), dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 16, 4)
    args = (torch.empty(10, 16, device=device, dtype=dtype),
            torch.randn(5, 64, device=device, dtype=dtype),
            torch.randn(4, 32, 64, device=device, dtype=dtype), None, sorted_ids, expert_ids,
            num_post_pad, 2, 16, True)
    torch.library.opcheck(torch.ops.pyorch.fused_moe_gemm.default, args)
    torch.library.opcheck(
        torch.ops.pyorch.moe_align_block_size.default,
        (ids, 4, 16, torch.empty_like(sorted_ids), torch.empty_like(expert_ids),
         torch.empty_like(num_post_pad), None))
