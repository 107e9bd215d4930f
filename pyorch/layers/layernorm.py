"""RMSNorm over pyorch's rms_norm / fused_add_rms_norm ops."""

import torch
from torch import nn

from pyorch import _ops


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, as in Llama/Qwen (HF's LlamaRMSNorm).

    forward(x) returns the normed x; forward(x, residual) first adds x to the residual stream and
    returns (normed, new_residual), overwriting both x and residual in place (vLLM's contract).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward_native(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pure-torch reference, rounding where HF rounds (the sum and the normed x in x.dtype)."""
        orig_dtype = x.dtype
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * xf.to(orig_dtype)
        return out if residual is None else (out, residual)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            _ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            return x, residual
        out = torch.empty_like(x)
        _ops.rms_norm(out, x, self.weight, self.variance_epsilon)
        return out

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
