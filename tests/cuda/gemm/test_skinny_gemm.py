"""skinny_gemm on CPU and CUDA against the float64 reference (tests/reference/gemm.py).

Weights are scaled by 1/sqrt(K), as trained ones roughly are, so outputs are O(1) at every K and
the per-dtype tolerance table applies as is. Outputs are poisoned with NaN first: every element
must be written.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, tol
from tests.reference import gemm as ref

DTYPES = [torch.float16, torch.bfloat16]
MAX_TOKENS = 16
# (output_size N, input_size K): N off the 16-row tile, K = 8 (one chunk) and K off the 128-wide
# slice, so the row clamp and the K-tail predicates both run.
SHAPES = [(1, 8), (17, 136), (83, 776), (769, 4104)]
# On CUDA only: Llama-3-8B's qkv_proj, o_proj and down (each launch configuration the launcher
# picks: 4 warps, 8 warps for K >= 8192, 16 warps from 4096 blocks on), and two large N off the
# 16-row tile with a K tail.
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (16400, 1032), (65544, 136)]


def _inputs(num_tokens: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool):
    x = torch.randn(num_tokens, k, dtype=dtype, device=device)
    w = (torch.randn(n, k, device=device) * max(k, 1) ** -0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    return x, w, b


def _run(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    _ops.skinny_gemm(out, x, w, b)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", range(1, MAX_TOKENS + 1))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm(device: str, dtype: torch.dtype, num_tokens: int, n: int, k: int, bias: bool):
    x, w, b = _inputs(num_tokens, n, k, dtype, device, bias)
    torch.testing.assert_close(_run(x, w, b), ref.linear(x, w, b), **tol(dtype))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
def test_skinny_gemm_llama_shapes(dtype: torch.dtype, num_tokens: int, n: int, k: int):
    x, w, b = _inputs(num_tokens, n, k, dtype, "cuda", bias=False)
    out = _run(x, w, b)
    torch.testing.assert_close(out, ref.linear(x, w, b), **tol(dtype))
    # Same inputs, same bits: each output is summed by one block in a fixed order.
    assert torch.equal(out, _run(x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_skinny_gemm_strided(device: str, dtype: torch.dtype, num_tokens: int):
    # x rows are a window of a wider buffer (row stride K + 24, start 8 elements in: still 16-byte
    # aligned); out is a column slice of a wider tensor, whose other columns stay untouched.
    n, k = 83, 392
    base = torch.randn(num_tokens, k + 24, dtype=dtype, device=device)
    x = base[:, 8 : 8 + k]
    w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device)
    out_base = torch.full((num_tokens, n + 16), 7.0, dtype=dtype, device=device)
    out = out_base[:, 8 : 8 + n]
    _ops.skinny_gemm(out, x, w, b)
    torch.testing.assert_close(out, ref.linear(x, w, b), **tol(dtype))
    assert (out_base[:, :8] == 7).all() and (out_base[:, 8 + n :] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_skinny_gemm_empty(device: str):
    x, w, b = _inputs(0, 24, 64, torch.bfloat16, device, bias=True)
    _ops.skinny_gemm(torch.empty(0, 24, dtype=torch.bfloat16, device=device), x, w, b)
    # K = 0: the sums are empty, out is the bias.
    x, w, b = _inputs(3, 24, 0, torch.bfloat16, device, bias=True)
    torch.testing.assert_close(_run(x, w, b), b.expand(3, 24))


@pytest.mark.parametrize("device", DEVICES)
def test_skinny_gemm_rejects_bad_inputs(device: str):
    x, w, b = _inputs(4, 32, 64, torch.bfloat16, device, bias=True)
    out = torch.empty(4, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="dtype"):  # fp32 is cuBLAS's
        _ops.skinny_gemm(out.float(), x.float(), w.float(), None)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.skinny_gemm(out, x, w.half(), b)
    with pytest.raises(RuntimeError, match="maximum"):  # M above the limit
        x17 = torch.randn(MAX_TOKENS + 1, 64, dtype=torch.bfloat16, device=device)
        _ops.skinny_gemm(torch.empty(MAX_TOKENS + 1, 32, dtype=torch.bfloat16, device=device),
                         x17, w, b)
    with pytest.raises(RuntimeError, match="multiple of 8"):  # K % 8 != 0
        _ops.skinny_gemm(out, x[:, :60], w[:, :60].contiguous(), b)
    with pytest.raises(RuntimeError, match="multiple of 8"):  # row stride % 8 != 0
        xs = torch.randn(4, 68, dtype=torch.bfloat16, device=device)[:, :64]
        _ops.skinny_gemm(out, xs, w, b)
    with pytest.raises(RuntimeError, match="aligned"):  # starts 2 bytes in
        xa = torch.randn(4, 72, dtype=torch.bfloat16, device=device)[:, 1:65]
        _ops.skinny_gemm(out, xa, w, b)
    with pytest.raises(RuntimeError, match="contiguous"):
        _ops.skinny_gemm(out, x, torch.randn(64, 32, dtype=torch.bfloat16, device=device).T, b)
    with pytest.raises(RuntimeError, match="out"):
        _ops.skinny_gemm(torch.empty(4, 31, dtype=torch.bfloat16, device=device), x, w, b)
    with pytest.raises(RuntimeError, match="bias"):
        _ops.skinny_gemm(out, x, w, b[:31])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(device: str, bias: bool):
    x, w, b = _inputs(3, 40, 64, torch.float16, device, bias)
    out = torch.empty(3, 40, dtype=torch.float16, device=device)
    torch.library.opcheck(torch.ops.pyorch.skinny_gemm.default, (out, x, w, b))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_skinny_gemm_cuda_graph():
    # Captured once, replayed on new inputs written into the same buffers.
    x, w, b = _inputs(4, 777, 1032, torch.bfloat16, "cuda", bias=True)
    out = torch.empty(4, 777, dtype=torch.bfloat16, device="cuda")
    _ops.skinny_gemm(out, x, w, b)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _ops.skinny_gemm(out, x, w, b)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, ref.linear(x, w, b), **tol(torch.bfloat16))
