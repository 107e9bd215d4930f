"""skinny_gemm_fused on CPU and CUDA: the float64 reference (tests/reference/gemm.py), and bit
equality with the unfused ops wherever the contract promises it (no norm: skinny_gemm followed by
silu_and_mul, or by the residual add).

Inputs are random and of residual-stream size (scale 4, so the norm does something), weights
scaled by 1/sqrt(K); outputs are poisoned with NaN first.
"""

import pytest
import torch

from pyorch import _C, _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol
from tests.reference import gemm as ref

DTYPES = [torch.float16, torch.bfloat16]
EPS = 1e-5
# (output_size N, input_size K): N off the tile (for silu_and_mul: d = N / 2 off the 8-row
# half-tile), K = 8 and K off the 128-wide slice (the K tail predicates run for the norm too).
SHAPES = [(2, 8), (34, 136), (166, 776), (770, 4104)]
LLAMA_SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336), (128256 // 8, 4096)]
# One rank of Llama-3-70B at TP=4 (qkv_proj, o_proj, gate_up, down) and TP=8 (qkv_proj, o_proj):
# the 8-warp picks without the hint (>= 512 blocks) and the few-long-rows ones.
TP_SHAPES = [(2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168), (1280, 8192), (8192, 1024)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool, norm: bool):
    x = (torch.randn(m, k, device=device) * 4).to(dtype)
    w = (torch.randn(n, k, device=device) * max(k, 1) ** -0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    g = (torch.rand(k, device=device) + 0.5).to(dtype) if norm else None
    return x, w, b, g


def _run(x, w, b, g, epilogue: str, out=None) -> torch.Tensor:
    if out is None:
        cols = w.shape[0] // 2 if epilogue == "silu_and_mul" else w.shape[0]
        out = torch.full((x.shape[0], cols), float("nan"), dtype=x.dtype, device=x.device)
    _ops.skinny_gemm_fused(out, x, w, b, g, EPS, epilogue)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("epilogue", ["store", "silu_and_mul"])
def test_fused_against_reference(device, dtype, num_tokens, n, k, bias, norm, epilogue):
    x, w, b, g = _inputs(num_tokens, n, k, dtype, device, bias, norm)
    expected = ref.linear_fused(x, w, b, g, EPS, epilogue)
    # The normed input is rounded once more than the float64 reference's, the SiLU product once.
    torch.testing.assert_close(_run(x, w, b, g, epilogue), expected, **tol(dtype, 2.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_add_against_reference(device, dtype, num_tokens, n, k, bias):
    x, w, b, _ = _inputs(num_tokens, n, k, dtype, device, bias, norm=False)
    residual = torch.randn(num_tokens, n, dtype=dtype, device=device) * 4
    expected = ref.linear_fused(x, w, b, None, EPS, "add", residual)
    _run(x, w, b, None, "add", residual)
    # The product is rounded before the add, so a last-bit difference in it (fp32 against float64
    # sums) can move the sum by one ulp of the sum, which is larger than the product's.
    ulp = torch.finfo(dtype).eps * expected.float().abs().max().item()
    torch.testing.assert_close(residual, expected, atol=ulp, rtol=tol(dtype)["rtol"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 16])
def test_unnormed_epilogues_equal_the_unfused_ops(device, dtype, num_tokens):
    n, k = 770, 1032
    x, w, b, _ = _inputs(num_tokens, n, k, dtype, device, bias=True, norm=False)
    product = torch.empty(num_tokens, n, dtype=dtype, device=device)
    _ops.skinny_gemm(product, x, w, b)
    assert torch.equal(_run(x, w, b, None, "store"), product)
    act = torch.empty(num_tokens, n // 2, dtype=dtype, device=device)
    _ops.silu_and_mul(act, product)
    assert torch.equal(_run(x, w, b, None, "silu_and_mul"), act)
    residual = torch.randn(num_tokens, n, dtype=dtype, device=device)
    expected = (residual.float() + product.float()).to(dtype)
    _run(x, w, b, None, "add", residual)
    assert torch.equal(residual, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", ["store", "silu_and_mul"])
def test_norm_close_to_rms_norm_then_gemm(device, dtype, epilogue):
    # What the decoder layer replaces: rms_norm (HF rounding), skinny_gemm, silu_and_mul.
    m, n, k = 4, 514, 2056
    x, w, b, g = _inputs(m, n, k, dtype, device, bias=False, norm=True)
    normed = torch.empty_like(x)
    _ops.rms_norm(normed, x, g, EPS)
    product = torch.empty(m, n, dtype=dtype, device=device)
    _ops.skinny_gemm(product, normed, w, None)
    if epilogue == "silu_and_mul":
        unfused = torch.empty(m, n // 2, dtype=dtype, device=device)
        _ops.silu_and_mul(unfused, product)
    else:
        unfused = product
    torch.testing.assert_close(_run(x, w, None, g, epilogue), unfused, **tol(dtype, 2.0))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_is_scale_invariant(device):
    # rms_norm(c * x) == rms_norm(x): a norm that used the wrong row sum would not be.
    x, w, _, g = _inputs(3, 64, 264, torch.bfloat16, device, bias=False, norm=True)
    a = _run(x, w, None, g, "store")
    b = _run((x.float() * 8).to(x.dtype), w, None, g, "store")  # exact: a power of two
    torch.testing.assert_close(a, b, **tol(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_strided_rows(device, dtype):
    # x rows a window of a wider buffer; out a column slice whose neighbours stay untouched.
    m, n, k = 5, 166, 392
    base = (torch.randn(m, k + 24, device=device) * 4).to(dtype)
    x = base[:, 8 : 8 + k]
    _, w, b, g = _inputs(m, n, k, dtype, device, bias=True, norm=True)
    out_base = torch.full((m, n // 2 + 16), 7.0, dtype=dtype, device=device)
    out = out_base[:, 8 : 8 + n // 2]
    _ops.skinny_gemm_fused(out, x, w, b, g, EPS, "silu_and_mul")
    expected = ref.linear_fused(x, w, b, g, EPS, "silu_and_mul")
    torch.testing.assert_close(out, expected, **tol(dtype, 2.0))
    assert (out_base[:, :8] == 7).all() and (out_base[:, 8 + n // 2 :] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rejects_bad_inputs(device):
    x, w, b, g = _inputs(4, 32, 64, torch.bfloat16, device, bias=True, norm=True)
    out = torch.empty(4, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="epilogue"):
        _ops.skinny_gemm_fused(out, x, w, b, g, EPS, "gelu")
    with pytest.raises(RuntimeError, match="epilogue"):
        torch.ops.pyorch.skinny_gemm_fused(out, x, w, b, g, EPS, 3)
    with pytest.raises(RuntimeError, match="no norm_weight"):
        _ops.skinny_gemm_fused(out, x, w, b, g, EPS, "add")
    with pytest.raises(RuntimeError, match="out"):  # silu_and_mul writes N / 2 columns
        _ops.skinny_gemm_fused(out, x, w, b, g, EPS, "silu_and_mul")
    with pytest.raises(RuntimeError, match="even"):
        _ops.skinny_gemm_fused(torch.empty(4, 15, dtype=torch.bfloat16, device=device), x,
                               w[:31], b[:31], g, EPS, "silu_and_mul")
    with pytest.raises(RuntimeError, match="norm_weight"):
        _ops.skinny_gemm_fused(out, x, w, b, g[:32], EPS, "store")
    with pytest.raises(RuntimeError, match="norm_weight dtype"):
        _ops.skinny_gemm_fused(out, x, w, b, g.half(), EPS, "store")
    with pytest.raises(RuntimeError, match="overlap"):
        xx = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
        _ops.skinny_gemm_fused(xx[:, :32], xx, w[:32, :64].contiguous(), None, None, EPS, "add")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epilogue", ["store", "silu_and_mul", "add"])
def test_opcheck(device, epilogue):
    norm = epilogue != "add"
    x, w, b, g = _inputs(3, 40, 64, torch.float16, device, bias=True, norm=norm)
    cols = 20 if epilogue == "silu_and_mul" else 40
    out = torch.randn(3, cols, dtype=torch.float16, device=device)
    index = _ops.SKINNY_EPILOGUES[epilogue]
    torch.library.opcheck(torch.ops.pyorch.skinny_gemm_fused.default,
                          (out, x, w, b, g, EPS, index))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
@pytest.mark.parametrize("n,k", LLAMA_SHAPES + TP_SHAPES)
@pytest.mark.parametrize("norm", [True, False])
def test_fused_llama_shapes(dtype, num_tokens, n, k, norm):
    # Every launch configuration the launcher picks (4, 8 and 16 warps, with and without the L2
    # hint; the normed picks differ from the plain ones), both epilogues and the add; the same
    # inputs give the same bits.
    x, w, _, g = _inputs(num_tokens, n, k, dtype, "cuda", bias=False, norm=norm)
    for epilogue in ("store", "silu_and_mul"):
        out = _run(x, w, None, g, epilogue)
        expected = ref.linear_fused(x, w, None, g, EPS, epilogue)
        torch.testing.assert_close(out, expected, **tol(dtype, 2.0))
        assert torch.equal(out, _run(x, w, None, g, epilogue))
    if not norm:
        residual = torch.randn(num_tokens, n, dtype=dtype, device="cuda") * 4
        expected = ref.linear_fused(x, w, None, None, EPS, "add", residual)
        _run(x, w, None, None, "add", residual)
        ulp = torch.finfo(dtype).eps * expected.float().abs().max().item()
        torch.testing.assert_close(residual, expected, atol=ulp, rtol=tol(dtype)["rtol"])


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_fused_cuda_graph():
    # The decoder layer's chain (normed silu_and_mul, then add) replayed on new inputs.
    m, d, k = 4, 392, 1032
    x, w_gu, _, g = _inputs(m, 2 * d, k, torch.bfloat16, "cuda", bias=False, norm=True)
    w_down = (torch.randn(k, d, device="cuda") * d**-0.5).to(torch.bfloat16)
    act = torch.empty(m, d, dtype=torch.bfloat16, device="cuda")
    residual = torch.empty_like(x)

    def chain():
        residual.copy_(x)
        _ops.skinny_gemm_fused(act, residual, w_gu, None, g, EPS, "silu_and_mul")
        _ops.skinny_gemm_fused(residual, act, w_down, None, None, EPS, "add")

    graph = capture_graph(chain)
    for _ in range(3):
        x.copy_((torch.randn_like(x, dtype=torch.float32) * 4).to(x.dtype))
        graph.replay()
        expected_act = ref.linear_fused(x, w_gu, None, g, EPS, "silu_and_mul")
        torch.testing.assert_close(act, expected_act, **tol(torch.bfloat16, 2.0))
        expected = ref.linear_fused(act, w_down, None, None, EPS, "add", x)
        torch.testing.assert_close(residual, expected, **tol(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdl", [None, False, True])
def test_pdl_is_a_launch_detail(device, pdl):
    # With or without programmatic dependent launch (a no-op on the CPU): the same bits.
    x, w, _, g = _inputs(3, 166, 776, torch.bfloat16, device, bias=False, norm=True)
    expected = _run(x, w, None, g, "silu_and_mul")
    out = torch.full_like(expected, float("nan"))
    _ops.skinny_gemm_fused(out, x, w, None, g, EPS, "silu_and_mul", pdl=pdl)
    assert torch.equal(out, expected)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("n,k", [(28672, 4096), (8192, 2048), (2560, 8192)])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_legacy_picks_compute_the_same_product(n, k, num_tokens):
    # PYORCH_SKINNY_GEMM_LEGACY_PICKS (the A/B switch) changes only the launch: the same values
    # within the tolerance (the fp32 sums run in another order), then the default picks again.
    x, w, _, g = _inputs(num_tokens, n, k, torch.bfloat16, "cuda", bias=False, norm=True)
    assert not _C.skinny_gemm_legacy_picks()
    try:
        _C.set_skinny_gemm_legacy_picks(True)
        legacy = {e: _run(x, w, None, g, e) for e in ("store", "silu_and_mul")}
    finally:
        _C.set_skinny_gemm_legacy_picks(False)
    for epilogue, out in legacy.items():
        expected = ref.linear_fused(x, w, None, g, EPS, epilogue)
        torch.testing.assert_close(out, expected, **tol(torch.bfloat16, 2.0))
        torch.testing.assert_close(_run(x, w, None, g, epilogue), out, **tol(torch.bfloat16, 2.0))
