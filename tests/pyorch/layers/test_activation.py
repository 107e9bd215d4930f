"""Gated activations: the op path against forward_native."""

import pytest
import torch

from pyorch.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul_fn
from tests.conftest import DEVICES, tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer", [SiluAndMul(), GeluAndMul("none"), GeluAndMul("tanh")],
                         ids=["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (7, 769), (83, 1376)])
def test_op_matches_native(device: str, dtype: torch.dtype, layer: torch.nn.Module,
                           num_tokens: int, d: int):
    x = torch.randn(num_tokens, 2 * d, dtype=dtype, device=device)
    out = layer(x)
    assert out.shape == (num_tokens, d)
    torch.testing.assert_close(out, layer.forward_native(x), **tol(dtype, 2))


def test_get_act_and_mul_fn():
    assert isinstance(get_act_and_mul_fn("silu"), SiluAndMul)
    assert get_act_and_mul_fn("gelu_pytorch_tanh").approximate == "tanh"
    with pytest.raises(ValueError, match="relu"):
        get_act_and_mul_fn("relu")
