"""The CUTLASS W8A8 GEMMs on CUDA (cuda/quantization/, cpp/ops/scaled_mm.cpp) against the float64
reference (tests/reference/quantization.py): cutlass_scaled_mm for fp8 and int8 with per-tensor,
per-token and per-channel scales, with and without bias, in every tile configuration the
launcher picks (m <= 16 and <= 64 swap A and B, <= 256 and larger do not); the zero-point variant
cutlass_scaled_mm_azp; the block-scaled fp8 GEMM with both scale layouts; and a CUDA graph.

The GEMMs accumulate exactly (int8) or in fp32 (fp8, fast accumulation) and round once to the
output dtype: compared with twice the per-dtype tolerance (more for fp8 into fp16, see _tol), on
fresh random data scaled so that outputs are O(1). Outputs start as NaN, so every element must be
written.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, capture_graph, tol
from tests.reference import quantization as ref

pytestmark = pytest.mark.skipif(
    not CUDA_AVAILABLE
    or not _ops.has_cuda_kernel("cutlass_scaled_mm")
    or not _ops._C.cutlass_scaled_mm_available(),
    reason="no CUDA device, or pyorch built without the CUTLASS scaled GEMMs",
)

OUT_DTYPES = [torch.bfloat16, torch.float16]
# m in each tile's range and off its edges: swap 64x16 (1, 13), swap 64x64 (17, 64), 64x128 or
# 128x128 by wave count (65, 200), 128x128 (333, 1031), int8's 128x256 from 2048 rows (2053).
MS = [1, 13, 17, 64, 65, 200, 333, 1031, 2053]
# (n, k): the smallest legal problem, n and k off every tile edge (multiples of 16 as required),
# and a Llama-3-8B-sized layer (o_proj) with a k tail.
NKS = [(16, 16), (272, 336), (4096, 1040)]
SCALES = [(False, False), (True, False), (False, True), (True, True)]  # per token, per channel


def _operands(kind: str, m: int, n: int, k: int):
    """a [m, k], w [n, k] (nn.Linear's layout; the op takes w.t()), and the unit that makes
    (a @ w.t()) * unit O(1)."""
    if kind == "fp8":
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        return a, w, 1.0 / k**0.5
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda")
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    return a, w, 1.0 / (5500.0 * k**0.5)


def _scales(m: int, n: int, unit: float, per_token: bool, per_channel: bool):
    sa = (torch.rand(m if per_token else 1, 1, device="cuda") + 0.5) * unit**0.5
    sb = (torch.rand(n if per_channel else 1, device="cuda") + 0.5) * unit**0.5
    return sa, sb


def _tol(kind: str, out_dtype: torch.dtype) -> dict:
    """Twice the output dtype's rounding; fp8's fast accumulation (the accumulator is not
    promoted to full fp32 between wgmma steps, as cuBLASLt's fast-accum mode) adds up to ~1e-3
    at these sizes, more than fp16's table allows."""
    if kind == "fp8" and out_dtype == torch.float16:
        return tol(out_dtype, 8)
    return tol(out_dtype, 2)


def _nan_out(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", NKS)
@pytest.mark.parametrize("per_token,per_channel", SCALES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_cutlass_scaled_mm(kind: str, out_dtype: torch.dtype, m: int, n: int, k: int,
                           per_token: bool, per_channel: bool, with_bias: bool):
    a, w, unit = _operands(kind, m, n, k)
    sa, sb = _scales(m, n, unit, per_token, per_channel)
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    out = _nan_out(m, n, out_dtype)
    torch.ops.pyorch.cutlass_scaled_mm(out, a, w.t(), sa, sb, bias)
    expected = ref.scaled_mm(a, w.t(), sa, sb, bias)
    torch.testing.assert_close(out, expected.to(out_dtype), **_tol(kind, out_dtype))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 13, 64, 200, 1031])
@pytest.mark.parametrize("n,k", NKS)
@pytest.mark.parametrize("per_token_azp", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cutlass_scaled_mm_azp(out_dtype: torch.dtype, m: int, n: int, k: int,
                               per_token_azp: bool, with_bias: bool):
    """vLLM's contract: per-tensor zero point folded into azp_adj = azp * colsum(b); per token,
    azp [m] with azp_adj = colsum(b). a holds q = x / s + azp, so the result is the product of
    the shifted activations."""
    a, w, unit = _operands("int8", m, n, k)
    sa, sb = _scales(m, n, unit, True, True)
    colsum = w.t().int().sum(dim=0, dtype=torch.int32)
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    out = _nan_out(m, n, out_dtype)
    if per_token_azp:
        azp = torch.randint(-100, 100, (m,), dtype=torch.int32, device="cuda")
        torch.ops.pyorch.cutlass_scaled_mm_azp(out, a, w.t(), sa, sb, colsum, azp, bias)
        shifted = a.double() - azp.double().reshape(-1, 1)
    else:
        torch.ops.pyorch.cutlass_scaled_mm_azp(out, a, w.t(), sa, sb, colsum * 37, None, bias)
        shifted = a.double() - 37
    expected = (shifted @ w.t().double()) * sa.double() * sb.double()
    if bias is not None:
        expected = expected + bias.double()
    torch.testing.assert_close(out, expected.to(out_dtype), **tol(out_dtype, 2))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 13, 130, 333])
@pytest.mark.parametrize("n,k", [(128, 128), (272, 384), (4096, 1024)])
@pytest.mark.parametrize("a_layout", ["column_major", "row_major"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cutlass_scaled_mm_block(out_dtype: torch.dtype, m: int, n: int, k: int, a_layout: str,
                                 with_bias: bool):
    """1 x 128 activation groups, 128 x 128 weight blocks. a_scales as per_token_group_quant_fp8
    gives them (column-major, the kernel's layout, or row-major, copied first); b_scales as vLLM
    passes them: the checkpoint's [n / 128, k / 128] weight_scale_inv transposed."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    kb, nb = k // 128, -(-n // 128)
    if a_layout == "column_major":
        sa = (torch.rand(kb, m, device="cuda") + 0.5).t() / k**0.5
    else:
        sa = (torch.rand(m, kb, device="cuda") + 0.5) / k**0.5
    sb = (torch.rand(nb, kb, device="cuda") + 0.5).t()
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    out = _nan_out(m, n, out_dtype)
    torch.ops.pyorch.cutlass_scaled_mm(out, a, w.t(), sa, sb, bias)
    expected = ref.scaled_mm(a, w.t(), sa, sb, bias, block=True)
    torch.testing.assert_close(out, expected.to(out_dtype), **_tol("fp8", out_dtype))


def test_cutlass_scaled_mm_strided_and_graph():
    """a and out as column windows of wider buffers (row strides a multiple of 16), and the same
    call replayed from a CUDA graph: no allocation or synchronization inside."""
    m, n, k = 40, 272, 336
    a_full = torch.randn(m, k + 32, device="cuda").to(torch.float8_e4m3fn)
    a = a_full[:, 16 : 16 + k]
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = _scales(m, n, 1.0 / k**0.5, True, True)
    out_full = torch.full((m, n + 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = out_full[:, :n]
    graph = capture_graph(lambda: torch.ops.pyorch.cutlass_scaled_mm(out, a, w.t(), sa, sb, None))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.scaled_mm(a, w.t(), sa, sb)
    torch.testing.assert_close(out, expected.to(torch.bfloat16), **tol(torch.bfloat16, 2))
    assert torch.isnan(out_full[:, n:]).all()  # nothing written past the view


def test_cutlass_scaled_mm_refuses_what_cuda_cannot_run():
    """Unsupported on CUDA (as in vLLM) and named in the error: float32 out, k or n off a
    multiple of 16, block scales with k off a multiple of 128."""
    a, w, _ = _operands("fp8", 8, 64, 128)
    one = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="out must be bfloat16 or float16"):
        torch.ops.pyorch.cutlass_scaled_mm(
            torch.empty(8, 64, device="cuda"), a, w.t(), one, one, None)
    a2, w2, _ = _operands("fp8", 8, 64, 120)
    with pytest.raises(RuntimeError, match="must be multiples of 16"):
        torch.ops.pyorch.cutlass_scaled_mm(
            torch.empty(8, 64, dtype=torch.bfloat16, device="cuda"), a2, w2.t(), one, one, None)
    a3, w3, _ = _operands("fp8", 8, 128, 144)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        torch.ops.pyorch.cutlass_scaled_mm(
            torch.empty(8, 128, dtype=torch.bfloat16, device="cuda"), a3, w3.t(),
            torch.ones(8, 2, device="cuda"), torch.ones(2, 1, device="cuda"), None)
