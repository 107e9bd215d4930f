"""Typed one-line wrappers over torch.ops.pyorch.* (the schemas live in cpp/torch_bindings.cpp).

Every op mutates its output arguments in place and returns None, like vLLM's _custom_ops.
"""

from typing import Optional

import torch

import pyorch._C  # noqa: F401  (registers the ops)

_ops = torch.ops.pyorch


# ---- norms --------------------------------------------------------------------------------------
def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out[..., h] = input / sqrt(mean(input^2) + eps) * weight."""
    _ops.rms_norm(out, input, weight, eps)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual += input; input = rms_norm(residual) * weight, both in place."""
    _ops.fused_add_rms_norm(input, residual, weight, eps)
