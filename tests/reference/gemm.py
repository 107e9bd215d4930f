"""Reference linear layer: x @ weight^T + bias in float64, rounded once to x's dtype."""

from typing import Optional

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
