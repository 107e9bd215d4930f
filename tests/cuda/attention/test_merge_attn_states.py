"""merge_attn_states on CPU and CUDA against the float64 reference, empty parts included."""

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import attention as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_parts(num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype, device: str,
               strided: bool = False):  # fmt: skip
    def output() -> torch.Tensor:
        if strided:  # token stride wider than num_heads * head_size
            base = torch.randn(num_tokens, num_heads, head_size + 8, dtype=dtype, device=device)
            return base[:, :, :head_size]
        return torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device)

    prefix_lse = torch.randn(num_heads, num_tokens, device=device) * 3
    suffix_lse = torch.randn(num_heads, num_tokens, device=device) * 3
    return output(), prefix_lse, output(), suffix_lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,head_size", [(1, 1, 64), (7, 32, 128), (83, 7, 80), (300, 4, 256), (5, 3, 100)])
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_merge(device: str, dtype: torch.dtype, num_tokens: int, num_heads: int, head_size: int,
               with_lse: bool, strided: bool) -> None:  # fmt: skip
    po, pl, so, sl = make_parts(num_tokens, num_heads, head_size, dtype, device, strided)
    out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype, device=device)
    out_lse = torch.empty(num_heads, num_tokens, device=device) if with_lse else None
    _ops.merge_attn_states(out, po, pl, so, sl, out_lse)
    want, want_lse = ref.merge_attn_states(po.cpu(), pl.cpu(), so.cpu(), sl.cpu())
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype))
    if with_lse:
        torch.testing.assert_close(out_lse.cpu().double(), want_lse, **tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts(device: str, dtype: torch.dtype) -> None:
    """-inf (and FlashAttention-2's +inf) mean an empty part; its output may be garbage."""
    num_tokens, num_heads, head_size = 6, 2, 64
    po, pl, so, sl = make_parts(num_tokens, num_heads, head_size, dtype, device)
    inf = float("inf")
    pl[:, 0], sl[:, 0] = -inf, 0.5  # empty prefix
    pl[:, 1], sl[:, 1] = 1.5, -inf  # empty suffix
    pl[:, 2], sl[:, 2] = -inf, -inf  # both empty -> zeros, lse -inf
    pl[:, 3], sl[:, 3] = inf, 0.25  # FA2-style empty prefix
    pl[:, 4], sl[:, 4] = inf, inf  # both empty, FA2 style
    po[0], so[1], po[2], so[2], po[3], po[4], so[4] = (float("nan"),) * 7
    out = torch.full_like(po, 7.0)
    out_lse = torch.zeros(num_heads, num_tokens, device=device)
    _ops.merge_attn_states(out, po, pl, so, sl, out_lse)
    want, want_lse = ref.merge_attn_states(po.cpu(), pl.cpu(), so.cpu(), sl.cpu())
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype))
    torch.testing.assert_close(out_lse.cpu().double(), want_lse, **tol(torch.float32))
    assert (out[2] == 0).all() and (out[4] == 0).all()
    assert (out_lse[:, 2] == -inf).all() and (out_lse[:, 4] == -inf).all()
    torch.testing.assert_close(out[0].cpu(), so[0].cpu(), **tol(dtype))
    torch.testing.assert_close(out[1].cpu(), po[1].cpu(), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_shapes(device: str) -> None:
    po, pl, so, sl = make_parts(4, 2, 64, torch.float32, device)
    out = torch.empty_like(po)
    with pytest.raises(RuntimeError, match="lse"):
        _ops.merge_attn_states(out, po, pl.T.contiguous(), so, sl)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        _ops.merge_attn_states(out.double(), po.double(), pl, so.double(), sl)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    po, pl, so, sl = make_parts(5, 3, 64, torch.bfloat16, device)
    out = torch.empty_like(po)
    out_lse = torch.empty_like(pl)
    torch.library.opcheck(torch.ops.pyorch.merge_attn_states.default, (out, out_lse, po, pl, so, sl))
    torch.library.opcheck(torch.ops.pyorch.merge_attn_states.default, (out, None, po, pl, so, sl))
