"""rms_norm and fused_add_rms_norm on CPU and CUDA against the float64 reference."""

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import norm as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 8), (7, 769), (83, 5120), (989, 111), (3, 4096)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(device: str, dtype: torch.dtype, num_tokens: int, hidden: int, strided: bool):
    base = torch.randn(num_tokens, hidden * (2 if strided else 1), dtype=dtype, device=device)
    x = base[:, :hidden]  # a non-contiguous row stride when strided
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out = torch.empty_like(x)
    _ops.rms_norm(out, x, weight, 1e-5)
    # Rounding the normalized value to the dtype, then the weight product, allows ~2 ulp.
    torch.testing.assert_close(out, ref.rms_norm(x, weight, 1e-5), **tol(dtype, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
def test_fused_add_rms_norm(device: str, dtype: torch.dtype, num_tokens: int, hidden: int):
    base = torch.randn(num_tokens, hidden + 3, dtype=dtype, device=device)
    x = base[:, 3:]
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    want_out, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    _ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, want_res, **tol(dtype))
    torch.testing.assert_close(x, want_out, **tol(dtype, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_3d(device: str):
    x = torch.randn(4, 5, 96, device=device)
    w = torch.randn(96, device=device)
    out = torch.empty_like(x)
    _ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_rejects_bad_weight(device: str):
    x = torch.randn(4, 64, device=device)
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="weight"):
        _ops.rms_norm(out, x, torch.randn(63, device=device), 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.rms_norm(out, x, torch.randn(64, device=device, dtype=torch.float16), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str):
    x = torch.randn(5, 128, device=device)
    w = torch.randn(128, device=device)
    torch.library.opcheck(torch.ops.pyorch.rms_norm.default, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(
        torch.ops.pyorch.fused_add_rms_norm.default, (x.clone(), x.clone(), w, 1e-6)
    )
