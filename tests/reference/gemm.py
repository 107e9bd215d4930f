"""Reference linear layer: x @ weight^T + bias in float64, rounded once to x's dtype."""

from typing import Optional

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def linear_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    eps: float,
    epilogue: str,
    out: Optional[torch.Tensor] = None,  # the "add" epilogue's input
) -> torch.Tensor:
    """skinny_gemm_fused in float64: rms_norm(x) * norm_weight (unrounded) @ weight^T + bias, then
    the epilogue, rounding to x's dtype where the op's contract does (gate and up before SiLU,
    the product before the add)."""
    xd = x.double()
    if norm_weight is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    p = xd @ weight.double().T
    if bias is not None:
        p = p + bias.double()
    if epilogue == "store":
        return p.to(x.dtype)
    if epilogue == "silu_and_mul":
        d = p.shape[-1] // 2
        gate, up = p[..., :d].to(x.dtype).double(), p[..., d:].to(x.dtype).double()
        return (gate * torch.sigmoid(gate) * up).to(x.dtype)
    assert epilogue == "add" and out is not None
    return (p.to(x.dtype).double() + out.double()).to(x.dtype)
