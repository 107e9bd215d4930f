"""The quantization ops (scaled_fp8_quant, scaled_int8_quant, per_token_group_quant_fp8,
rms_norm_dynamic_per_token_quant, silu_and_mul_dynamic_per_token_quant, cutlass_scaled_mm,
cutlass_scaled_mm_azp) on CPU and CUDA against the float64 reference
(tests/reference/quantization.py, norm.py, activation.py) and, for the fused norm and activation,
against the two ops each fuses.

The quantizers are exact: every step is one correctly rounded fp32 operation, so the quantized
values and scales must equal the reference bit for bit. The GEMMs accumulate in fp32 (fp8) or
int32 (int8) and round once to the output dtype, compared with the per-dtype tolerance. Outputs
start as NaN (or a sentinel) so every element must be written.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import activation as ref_act
from tests.reference import norm as ref_norm
from tests.reference import quantization as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_tokens, hidden): one token, odd sizes, and a row longer than one thread block's chunk;
# on CUDA, odd sizes take the element-wise fp8 kernel and rows of whole 16-byte vectors the
# register-resident one (one, two and seven vectors a thread at 4096, 4104 and 14336).
SHAPES = [(1, 8), (7, 111), (83, 769), (33, 5125), (5, 4096), (3, 4104), (2, 14336)]


def _input(t: int, h: int, dtype: torch.dtype, device: str, strided: bool) -> torch.Tensor:
    """Values spanning several binades (so fp8 rounds at many exponents), optionally a column
    window of a wider buffer (row stride h + 24)."""
    x = torch.randn(t, h + (24 if strided else 0), device=device) * 3
    x = x * torch.exp2(torch.randint(-6, 4, x.shape, device=device).float())
    x = x.to(dtype)
    return x[:, 8 : 8 + h] if strided else x


def _assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(actual.float(), expected.float(), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_static_scaled_fp8_quant(device: str, dtype: torch.dtype, t: int, h: int, strided: bool):
    x = _input(t, h, dtype, device, strided)
    scale = torch.tensor([0.037], device=device)
    q, s = _ops.scaled_fp8_quant(x, scale)
    assert s is scale
    _assert_fp8_equal(q.cpu(), ref.fp8_quant(x.cpu(), scale.cpu()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_dynamic_scaled_fp8_quant(device: str, dtype: torch.dtype, t: int, h: int, strided: bool):
    x = _input(t, h, dtype, device, strided)
    q, s = _ops.scaled_fp8_quant(x)
    expected_scale = ref.dynamic_fp8_scale(x.cpu())
    torch.testing.assert_close(s.cpu().double(), expected_scale, atol=0, rtol=0)
    _assert_fp8_equal(q.cpu(), ref.fp8_quant(x.cpu(), expected_scale))
    # Saturation: the largest value maps to +-448 exactly.
    assert q.float().abs().max().item() == 448.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("scale_ub", [None, 2.5])
def test_dynamic_per_token_scaled_fp8_quant(
    device: str, dtype: torch.dtype, t: int, h: int, scale_ub
):
    x = _input(t, h, dtype, device, strided=False)
    x[0] = 0  # an all-zero row takes the minimum scale
    ub = None if scale_ub is None else torch.tensor([scale_ub], device=device)
    q, s = _ops.scaled_fp8_quant(x, scale_ub=ub, use_per_token_if_dynamic=True)
    expected_scales = ref.per_token_fp8_scales(x.cpu(), scale_ub)
    assert s.shape == (t, 1)
    torch.testing.assert_close(s.cpu().double(), expected_scales, atol=0, rtol=0)
    _assert_fp8_equal(q.cpu(), ref.fp8_quant(x.cpu(), expected_scales))


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_fp8_quant_padding_and_zero_rows(device: str):
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    q, _ = _ops.scaled_fp8_quant(x, torch.tensor([0.1], device=device), num_token_padding=16)
    assert q.shape == (16, 64)
    _assert_fp8_equal(q[:5].cpu(), ref.fp8_quant(x.cpu(), torch.tensor([0.1])))
    empty = torch.empty(0, 64, device=device, dtype=torch.bfloat16)
    q, s = _ops.scaled_fp8_quant(empty, use_per_token_if_dynamic=True)
    assert q.shape == (0, 64) and s.shape == (0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("azp", [None, -7])
def test_static_scaled_int8_quant(device: str, dtype: torch.dtype, t: int, h: int, azp):
    x = _input(t, h, dtype, device, strided=True)
    scale = torch.tensor([0.05], device=device)
    azp_t = None if azp is None else torch.tensor([azp], dtype=torch.int32, device=device)
    q, s, z = _ops.scaled_int8_quant(x, scale, azp_t, symmetric=azp is None)
    assert q.dtype == torch.int8 and s is scale and z is azp_t
    torch.testing.assert_close(q.cpu(), ref.static_int8(x.cpu(), 0.05, azp), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_dynamic_scaled_int8_quant(device: str, dtype: torch.dtype, t: int, h: int,
                                   symmetric: bool):
    x = _input(t, h, dtype, device, strided=False)
    x[0] = 0  # an all-zero row
    if t > 2:
        x[1] = 1.5  # a constant row
    q, s, z = _ops.scaled_int8_quant(x, symmetric=symmetric)
    if symmetric:
        eq, es = ref.dynamic_int8_symmetric(x.cpu())
        assert z is None
    else:
        eq, es, ez = ref.dynamic_int8_asymmetric(x.cpu())
        torch.testing.assert_close(z.cpu(), ez, atol=0, rtol=0)
    torch.testing.assert_close(s.cpu().double(), es, atol=0, rtol=0)
    torch.testing.assert_close(q.cpu(), eq, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,group_size", [(1, 128, 128), (7, 384, 128), (83, 1024, 128),
                                             (5, 192, 64)])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_group_quant_fp8(device: str, dtype: torch.dtype, t: int, k: int,
                                   group_size: int, column_major: bool, ue8m0: bool):
    x = _input(t, k, dtype, device, strided=False)
    x[0, :group_size] = 0  # a zero group takes eps / 448
    q, s = _ops.per_token_group_quant_fp8(x, group_size, column_major_scales=column_major,
                                          use_ue8m0=ue8m0)
    eq, es = ref.per_token_group_fp8(x.cpu(), group_size, 1e-10, ue8m0)
    assert s.shape == (t, k // group_size)
    if column_major:
        assert s.stride() == (1, t)
    torch.testing.assert_close(s.cpu(), es, atol=0, rtol=0)
    _assert_fp8_equal(q.cpu(), eq)


# ---- RMSNorm + per-token fp8 quantization ------------------------------------------------------
def _norm_quant_inputs(t: int, h: int, dtype: torch.dtype, device: str, strided: bool):
    x = _input(t, h, dtype, device, strided)
    weight = (torch.rand(h, device=device) + 0.5).to(dtype)
    residual = _input(t, h, dtype, device, strided=False)
    return x, weight, residual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("scale_ub", [None, 0.5])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_dynamic_per_token_quant_is_the_two_ops(
    device: str, dtype: torch.dtype, t: int, h: int, with_residual: bool, scale_ub, strided: bool
):
    """The fused op equals rms_norm (fused_add_rms_norm with a residual) and then the per-token
    fp8 quantization on the same device bit for bit (on CUDA, rows of whole 16-byte vectors run
    one kernel, others the two ops), leaves input alone, and updates the residual as
    fused_add_rms_norm does."""
    x, weight, residual = _norm_quant_inputs(t, h, dtype, device, strided)
    x_before = x.clone()
    ub = None if scale_ub is None else torch.tensor([scale_ub], device=device)
    expected_residual = residual.clone()
    normed = x.clone()
    if with_residual:
        _ops.fused_add_rms_norm(normed, expected_residual, weight, 1e-5)
    else:
        _ops.rms_norm(normed, x, weight, 1e-5)
    expected_q, expected_s = _ops.scaled_fp8_quant(normed, scale_ub=ub,
                                                   use_per_token_if_dynamic=True)

    q, s = _ops.rms_norm_dynamic_per_token_quant(
        x, weight, 1e-5, torch.float8_e4m3fn, scale_ub=ub,
        residual=residual if with_residual else None)
    assert q.shape == x.shape and s.shape == (t, 1)
    torch.testing.assert_close(s, expected_s, atol=0, rtol=0)
    _assert_fp8_equal(q, expected_q)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(3, 4096), (2, 769)])
def test_rms_norm_dynamic_per_token_quant_against_float64(device: str, dtype: torch.dtype, t: int,
                                                          h: int):
    """Against the float64 RMSNorm reference (tests/reference/norm.py): the fp8 values within
    half an fp8 step (6.25%) of it, plus one step where the norm's fp32 sum rounds the normed value
    one bf16 step away and that moves it across an fp8 rounding boundary (hence 20%); the scales
    within that bf16 step of the reference's."""
    x, weight, residual = _norm_quant_inputs(t, h, dtype, device, strided=False)
    expected_normed, expected_residual = ref_norm.fused_add_rms_norm(
        x.cpu(), residual.cpu(), weight.cpu(), 1e-5)
    expected_scales = ref.per_token_fp8_scales(expected_normed)
    q, s = _ops.rms_norm_dynamic_per_token_quant(x, weight, 1e-5, torch.float8_e4m3fn,
                                                 residual=residual)
    torch.testing.assert_close(residual.cpu(), expected_residual, **tol(dtype))
    torch.testing.assert_close(s.cpu().double(), expected_scales, rtol=2e-2, atol=0)
    dequant = q.cpu().double() * s.cpu().double()
    torch.testing.assert_close(dequant, expected_normed.double(), rtol=0.2,
                               atol=float(expected_scales.max()) * 2)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_dynamic_per_token_quant_rejects_bad_input(device: str):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="an int8 result is not supported"):
        _ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, torch.int8)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous \[64\]"):
        _ops.rms_norm_dynamic_per_token_quant(x, w[:32], 1e-5, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="weight dtype"):
        _ops.rms_norm_dynamic_per_token_quant(x, w.float(), 1e-5, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="residual .* must match input"):
        _ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, torch.float8_e4m3fn,
                                              residual=torch.zeros(4, 32, device=device,
                                                                   dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="scale_ub must be one float32 value"):
        _ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, torch.float8_e4m3fn,
                                              scale_ub=torch.ones(2, device=device))
    out = torch.empty(4, 64, device=device, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="scale dtype must be Float"):
        torch.ops.pyorch.rms_norm_dynamic_per_token_quant(
            out, x, w, torch.empty(4, 1, device=device, dtype=torch.float64), 1e-5, None, None)


# ---- silu_and_mul + per-token fp8 quantization -------------------------------------------------
# (num_tokens, d): d of 1 and 7 (off the 16-byte vector), 136 and 4104 (one and two vectors a
# thread on CUDA's fused kernel), Llama-3-8B's 14336, and 40000 (past 16 vectors a thread for
# 16-bit types: CUDA runs the two ops).
ACT_SHAPES = [(1, 1), (7, 7), (83, 136), (3, 4104), (2, 14336), (2, 40000)]
# How the [t, 2d] input is laid out: a contiguous tensor, a column window of a wider buffer
# (16-byte aligned: row stride 2d + 24), the same one element off (CUDA runs the two ops), and a
# 3-D view [1, t, 2d].
ACT_LAYOUTS = ["contiguous", "strided", "offset1", "3d"]


def _act_input(t: int, d: int, dtype: torch.dtype, device: str, layout: str) -> torch.Tensor:
    offset = {"strided": 8, "offset1": 1}.get(layout, 0)
    x = _input(t, 2 * d + 24 if offset else 2 * d, dtype, device, strided=False)
    x = x[:, offset : offset + 2 * d] if offset else x
    return x.unsqueeze(0) if layout == "3d" else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", ACT_SHAPES)
@pytest.mark.parametrize("layout", ACT_LAYOUTS)
@pytest.mark.parametrize("scale_ub", [None, 0.5])
def test_silu_and_mul_dynamic_per_token_quant_is_the_two_ops(
    device: str, dtype: torch.dtype, t: int, d: int, layout: str, scale_ub
):
    """The fused op equals silu_and_mul and then the per-token fp8 quantization on the same device
    bit for bit (on CUDA, aligned rows of whole 16-byte vectors run one kernel, others the two
    ops), with an all-zero row (the minimum scale), and leaves input alone."""
    x = _act_input(t, d, dtype, device, layout)
    x[..., 0, :] = 0
    x_before = x.clone()
    ub = None if scale_ub is None else torch.tensor([scale_ub], device=device)
    act = torch.empty(*x.shape[:-1], d, device=device, dtype=dtype)
    _ops.silu_and_mul(act, x)
    expected_q, expected_s = _ops.scaled_fp8_quant(act.reshape(-1, d), scale_ub=ub,
                                                   use_per_token_if_dynamic=True)

    q, s = _ops.silu_and_mul_dynamic_per_token_quant(x, torch.float8_e4m3fn, scale_ub=ub)
    assert q.shape == act.shape and s.shape == (t, 1)
    torch.testing.assert_close(s, expected_s, atol=0, rtol=0)
    _assert_fp8_equal(q.reshape(-1, d), expected_q)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(3, 4096), (2, 769)])
@pytest.mark.parametrize("scale_ub", [None, 0.5])
def test_silu_and_mul_dynamic_per_token_quant_against_float64(device: str, dtype: torch.dtype,
                                                              t: int, d: int, scale_ub):
    """Against silu(gate) * up in float64 rounded once to dtype (tests/reference/activation.py),
    quantized by the float64 reference: the scales within a dtype step of the reference's (the
    ops' fp32 silu may round the product one step away), the fp8 values (in units of the scale)
    within one fp8 step of the reference's: half a step of rounding (6.25%) plus the one step the
    product's last bit can move it across a rounding boundary."""
    x = _act_input(t, d, dtype, device, "contiguous")
    exact = ref_act.exact("silu_and_mul", x.cpu())
    expected_scales = ref.per_token_fp8_scales(exact, scale_ub)
    ub = None if scale_ub is None else torch.tensor([scale_ub], device=device)
    q, s = _ops.silu_and_mul_dynamic_per_token_quant(x, scale_ub=ub)
    torch.testing.assert_close(s.cpu().double(), expected_scales, rtol=1e-2, atol=0)
    want = (exact.double() / expected_scales).clamp(-448, 448)
    torch.testing.assert_close(q.cpu().double(), want, rtol=0.13, atol=2.0**-8)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_dynamic_per_token_quant_rejects_bad_input(device: str):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    op = torch.ops.pyorch.silu_and_mul_dynamic_per_token_quant

    def outs(d: int = 32, dtype: torch.dtype = torch.float8_e4m3fn, rows: int = 4):
        return (torch.empty(4, d, device=device, dtype=dtype),
                torch.empty(rows, 1, device=device, dtype=torch.float32))

    with pytest.raises(RuntimeError, match="an int8 result is not supported"):
        _ops.silu_and_mul_dynamic_per_token_quant(x, torch.int8)
    with pytest.raises(RuntimeError, match="result dtype must be Float8_e4m3fn"):
        _ops.silu_and_mul_dynamic_per_token_quant(x, torch.bfloat16)
    with pytest.raises(RuntimeError, match="input dtype must be float32, float16 or bfloat16"):
        _ops.silu_and_mul_dynamic_per_token_quant(x.to(torch.int32))
    with pytest.raises(RuntimeError, match="last dimension of input .* must be even"):
        _ops.silu_and_mul_dynamic_per_token_quant(x[:, :63])
    result, scale = outs(d=64)
    with pytest.raises(RuntimeError, match="result must be input's shape with the last dimension "
                                           "halved"):
        op(result, x, scale, None)
    result, scale = outs(rows=3)
    with pytest.raises(RuntimeError, match=r"scale must be contiguous with one value per token "
                                           r"\(4\)"):
        op(result, x, scale, None)
    result, _ = outs()
    with pytest.raises(RuntimeError, match="scale dtype must be Float"):
        op(result, x, torch.empty(4, 1, device=device, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="scale_ub must be one float32 value"):
        _ops.silu_and_mul_dynamic_per_token_quant(x, scale_ub=torch.ones(2, device=device))
    with pytest.raises(RuntimeError, match="last dimension of input must be contiguous"):
        _ops.silu_and_mul_dynamic_per_token_quant(torch.randn(64, 4, device=device).t())


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_dynamic_per_token_quant_opcheck(device: str):
    """The dispatcher's view of the op (fake tensors, autograd registration, AOT dispatch).
    Not opcheck's test_schema: its mutation check multiplies the fp8 result, which torch does not
    implement for float8_e4m3fn ("mul_cpu_reduced_float" not implemented)."""
    x = torch.randn(5, 2 * 136, device=device, dtype=torch.bfloat16)
    result = torch.empty(5, 136, device=device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(5, 1, device=device, dtype=torch.float32)
    torch.library.opcheck(torch.ops.pyorch.silu_and_mul_dynamic_per_token_quant.default,
                          (result, x, scale, None),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
def test_quant_ops_reject_bad_input(device: str):
    x = torch.randn(4, 96, device=device)
    with pytest.raises(RuntimeError, match="input dtype must be float32, float16 or bfloat16"):
        _ops.scaled_fp8_quant(x.to(torch.int32))
    with pytest.raises(RuntimeError, match="scale must be one float32 value"):
        _ops.scaled_fp8_quant(x, torch.tensor([1.0], dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        _ops.per_token_group_quant_fp8(x, 128)
    with pytest.raises(RuntimeError, match="last dimension of input must be contiguous"):
        _ops.scaled_int8_quant(x.t(), torch.tensor([1.0], device=device))


# ---- GEMMs ------------------------------------------------------------------------------------
def _skip_without_gemm_kernel(device: str, op: str = "cutlass_scaled_mm",
                              out_dtype: torch.dtype = torch.bfloat16, n: int = 16,
                              k: int = 16) -> None:
    # The CUTLASS kernels come with their own adapters (wt-fp8gemm); until a build has them,
    # the CUDA cases of the GEMM tests say so instead of failing on a missing kernel. On CUDA
    # they take bf16/fp16 out and K, N multiples of 16 (16-byte aligned rows, as vLLM's); the
    # CPU kernels take any size and fp32 out too (the CPU engine runs fp32 models).
    if device != "cuda":
        return
    if not _ops.has_cuda_kernel(op):
        pytest.skip(f"{op} has no CUDA kernel in this build")
    if out_dtype == torch.float32 or n % 16 or k % 16:
        pytest.skip("the CUDA GEMMs take bf16/fp16 out and K, N multiples of 16 (CPU only)")


def _fp8_operands(m: int, n: int, k: int, device: str):
    a = (torch.randn(m, k, device=device) * 8).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=device) * 8).to(torch.float8_e4m3fn)
    return a, w


def _int8_operands(m: int, n: int, k: int, device: str):
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    return a, w


# Awkward sizes (CPU), and sizes in the CUDA kernels' 16-element alignment.
MM_SHAPES = [(1, 16, 32), (7, 83, 129), (83, 256, 769), (33, 5125, 256), (7, 96, 128),
             (83, 272, 784), (33, 5120, 256)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", MM_SHAPES)
@pytest.mark.parametrize("per_token,per_channel", [(False, False), (True, False), (False, True),
                                                   (True, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_cutlass_scaled_mm(device: str, kind: str, out_dtype: torch.dtype, m: int, n: int,
                           k: int, per_token: bool, per_channel: bool, bias: bool):
    _skip_without_gemm_kernel(device, out_dtype=out_dtype, n=n, k=k)
    a, w = (_fp8_operands if kind == "fp8" else _int8_operands)(m, n, k, device)
    # Scales that make the outputs O(1): |a @ b| grows like sqrt(k) * (8 or 74)^2.
    unit = 1.0 / ((64.0 if kind == "fp8" else 5500.0) * k**0.5)
    sa = (torch.rand(m if per_token else 1, 1, device=device) + 0.5) * unit**0.5
    sb = (torch.rand(n if per_channel else 1, device=device) + 0.5) * unit**0.5
    b = torch.randn(n, device=device).to(out_dtype) if bias else None
    out = _ops.cutlass_scaled_mm(a, w.t(), sa, sb, out_dtype, b)
    expected = ref.scaled_mm(a.cpu(), w.t().cpu(), sa.cpu(), sb.cpu(), None if b is None
                             else b.cpu())
    # Hopper's fp8 tensor cores accumulate with fewer mantissa bits than fp32 (CUTLASS's fast
    # accumulation, which vLLM also uses): at k = 784 the H100 run was off by up to 0.0039 on
    # O(1) fp16 outputs, twice the exact-accumulation tolerance.
    scale = 8 if kind == "fp8" and device == "cuda" else 2
    torch.testing.assert_close(out.cpu(), expected.to(out_dtype), **tol(out_dtype, scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (7, 256, 384), (83, 200, 300), (16, 384, 1024)])
def test_cutlass_scaled_mm_block(device: str, out_dtype: torch.dtype, m: int, n: int, k: int):
    _skip_without_gemm_kernel(device, out_dtype=out_dtype, n=n, k=k)
    a, w = _fp8_operands(m, n, k, device)
    kb, nb = -(-k // 128), -(-n // 128)
    sa = (torch.rand(kb, m, device=device) + 0.5).t() / (8 * k**0.5)  # column-major, as vLLM
    sb = (torch.rand(kb, nb, device=device) + 0.5) / 8
    bias = torch.randn(n, device=device).to(out_dtype)
    out = _ops.cutlass_scaled_mm(a, w.t(), sa, sb, out_dtype, bias)
    expected = ref.scaled_mm(a.cpu(), w.t().cpu(), sa.cpu(), sb.cpu(), bias.cpu(), block=True)
    torch.testing.assert_close(out.cpu(), expected.to(out_dtype), **tol(out_dtype, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", MM_SHAPES)
@pytest.mark.parametrize("per_token_azp", [False, True])
def test_cutlass_scaled_mm_azp(device: str, out_dtype: torch.dtype, m: int, n: int, k: int,
                               per_token_azp: bool):
    _skip_without_gemm_kernel(device, "cutlass_scaled_mm_azp", out_dtype, n, k)
    a, w = _int8_operands(m, n, k, device)
    colsum = w.t().int().sum(dim=0, dtype=torch.int32)  # [N]
    unit = 1.0 / (5500.0 * k**0.5)
    sa = (torch.rand(m, 1, device=device) + 0.5) * unit**0.5
    sb = (torch.rand(n, device=device) + 0.5) * unit**0.5
    if per_token_azp:
        azp = torch.randint(-20, 20, (m,), dtype=torch.int32, device=device)
        out = _ops.cutlass_scaled_mm_azp(a, w.t(), sa, sb, out_dtype, colsum, azp)
        shifted = a.cpu().double() - azp.cpu().double().reshape(-1, 1)
    else:
        azp_adj = (colsum * 11).int()
        out = _ops.cutlass_scaled_mm_azp(a, w.t(), sa, sb, out_dtype, azp_adj)
        shifted = a.cpu().double() - 11
    expected = (shifted @ w.t().cpu().double()) * sa.cpu().double() * sb.cpu().double()
    torch.testing.assert_close(out.cpu(), expected.to(out_dtype), **tol(out_dtype, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_cutlass_scaled_mm_rejects_bad_input(device: str):
    _skip_without_gemm_kernel(device)
    a, w = _fp8_operands(8, 64, 128, device)
    one = torch.ones(1, device=device)
    with pytest.raises(RuntimeError, match="b must be column-major"):
        _ops.cutlass_scaled_mm(a, w.t().contiguous(), one, one, torch.bfloat16)
    with pytest.raises(RuntimeError, match="out dtype must be"):
        _ops.cutlass_scaled_mm(a, w.t(), one, one, torch.int32)
    with pytest.raises(RuntimeError, match="b dtype"):
        _ops.cutlass_scaled_mm(a, w.t().to(torch.float32).to(torch.int8), one, one, torch.float16)
    with pytest.raises(RuntimeError, match="scales must be per-tensor"):
        _ops.cutlass_scaled_mm(a, w.t(), torch.ones(3, device=device), one, torch.bfloat16)
    ai, wi = _int8_operands(8, 256, 256, device)
    with pytest.raises(RuntimeError, match="block-wise scales need float8_e4m3fn"):
        _ops.cutlass_scaled_mm(ai, wi.t(), torch.ones(8, 2, device=device),
                               torch.ones(2, 2, device=device), torch.bfloat16)
