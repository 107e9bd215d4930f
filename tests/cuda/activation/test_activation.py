"""silu_and_mul, gelu_and_mul and gelu_tanh_and_mul on CPU and CUDA against pure-torch references.

The ops compute in fp32 and round once. vLLM's forward_native (reference.native) rounds twice in
16-bit dtypes (the activation, then the product), so the two may differ by up to 2 ulps there:
that comparison gets twice the dtype tolerance, while the float64 value rounded once
(reference.exact) is held to the plain table.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import activation as ref

OPS = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 111), (7, 769), (83, 5125), (989, 111), (989, 769), (7, 5125), (3, 4096)]


def _run(op: str, out: torch.Tensor, x: torch.Tensor) -> None:
    getattr(_ops, op)(out, x)


def _check(op: str, out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out, ref.exact(op, x), **tol(dtype))
    native_scale = 1.0 if dtype == torch.float32 else 2.0
    torch.testing.assert_close(out, ref.native(op, x), **tol(dtype, native_scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", SHAPES)
def test_act_and_mul(device: str, op: str, dtype: torch.dtype, num_tokens: int, d: int):
    # 3x the usual spread reaches the saturated tails of every activation.
    x = 3 * torch.randn(num_tokens, 2 * d, dtype=dtype, device=device)
    out = torch.empty(num_tokens, d, dtype=dtype, device=device)
    _run(op, out, x)
    _check(op, out, x, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_act_and_mul_strided(device: str, op: str, dtype: torch.dtype, offset: int):
    # Input rows are a window of a wider buffer (row stride != 2d, start shifted by `offset`
    # elements, so offset 1 breaks 16-byte alignment); out is a column slice of a wider tensor.
    num_tokens, d = 83, 768
    base = torch.randn(num_tokens, 2 * d + 24, dtype=dtype, device=device)
    x = base[:, offset : offset + 2 * d]
    out_base = torch.full((num_tokens, d + 16), 7.0, dtype=dtype, device=device)
    out = out_base[:, 8 : 8 + d]
    _run(op, out, x)
    _check(op, out, x, dtype)
    assert (out_base[:, :8] == 7).all() and (out_base[:, 8 + d :] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_3d(device: str, op: str):
    x = torch.randn(4, 5, 2 * 96, device=device, dtype=torch.bfloat16)
    out = torch.empty(4, 5, 96, device=device, dtype=torch.bfloat16)
    _run(op, out, x)
    _check(op, out, x, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_extremes(device: str, op: str):
    # Saturation and special values: large |x|, zeros, infinities in the up half.
    gate = torch.tensor([-1e4, -100.0, -20.0, -5.0, 0.0, 5.0, 20.0, 100.0, 1e4], device=device)
    x = torch.cat((gate, torch.full_like(gate, 0.5)))
    out = torch.empty_like(gate)
    _run(op, out, x)
    _check(op, out, x, torch.float32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_empty(device: str, op: str):
    x = torch.empty(0, 64, device=device)
    out = torch.empty(0, 32, device=device)
    _run(op, out, x)


@pytest.mark.parametrize("device", DEVICES)
def test_act_and_mul_rejects_bad_inputs(device: str):
    x = torch.randint(0, 10, (4, 64), dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.silu_and_mul(torch.empty(4, 32, dtype=torch.int32, device=device), x)
    with pytest.raises(RuntimeError, match="even"):
        _ops.silu_and_mul(torch.empty(4, 32, device=device), torch.randn(4, 65, device=device))
    with pytest.raises(RuntimeError, match="halved"):
        _ops.gelu_and_mul(torch.empty(4, 64, device=device), torch.randn(4, 64, device=device))
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.gelu_tanh_and_mul(
            torch.empty(4, 32, device=device, dtype=torch.float16),
            torch.randn(4, 64, device=device),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(device: str, op: str):
    x = torch.randn(5, 2 * 80, device=device)
    out = torch.empty(5, 80, device=device)
    torch.library.opcheck(getattr(torch.ops.pyorch, op).default, (out, x))
