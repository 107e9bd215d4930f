"""RMSNorm: the op path against forward_native and against HF's LlamaRMSNorm."""

import pytest
import torch

from pyorch.layers.layernorm import RMSNorm
from tests.conftest import DEVICES, tol

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _norm(hidden: int, dtype: torch.dtype, device: str, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(hidden, eps=eps, dtype=dtype).to(device)
    norm.weight.data.normal_(1.0, 0.1)
    return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 769), (83, 128)])
def test_rms_norm_matches_native(device: str, dtype: torch.dtype, num_tokens: int, hidden: int):
    norm = _norm(hidden, dtype, device)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    torch.testing.assert_close(norm(x), norm.forward_native(x), **tol(dtype, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_matches_native(device: str, dtype: torch.dtype):
    norm = _norm(96, dtype, device, eps=1e-5)
    x = torch.randn(19, 96, dtype=dtype, device=device)
    residual = torch.randn(19, 96, dtype=dtype, device=device)
    want_out, want_res = norm.forward_native(x.clone(), residual.clone())
    out, res = norm(x, residual)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == residual.data_ptr()  # in place
    torch.testing.assert_close(res, want_res, **tol(dtype))
    torch.testing.assert_close(out, want_out, **tol(dtype, 2))


def test_native_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data.normal_(1.0, 0.1)
    ours = RMSNorm(64, eps=1e-5)
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(5, 64)
    torch.testing.assert_close(ours.forward_native(x), hf(x))
    torch.testing.assert_close(ours(x), hf(x))
