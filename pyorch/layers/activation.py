"""Gated activations over pyorch's *_and_mul ops: out = act(x[..., :d]) * x[..., d:]."""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyorch import _ops


def _out_for(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)


class SiluAndMul(nn.Module):
    """SwiGLU: silu(gate) * up on the merged [gate | up] projection."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        out = _out_for(x)
        _ops.silu_and_mul(out, x)
        return out


class GeluAndMul(nn.Module):
    """GeGLU: gelu(gate) * up, exact ("none") or tanh-approximated ("tanh")."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(
                f"GeluAndMul: approximate must be 'none' or 'tanh', not {approximate!r}")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        out = _out_for(x)
        if self.approximate == "none":
            _ops.gelu_and_mul(out, x)
        else:
            _ops.gelu_tanh_and_mul(out, x)
        return out

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# HF `hidden_act` names of gated MLPs -> the layer that computes act(gate) * up.
_ACT_AND_MUL: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul_fn(act_fn_name: str) -> nn.Module:
    """The gated-activation layer for an HF config's `hidden_act`."""
    name = act_fn_name.lower()
    if name not in _ACT_AND_MUL:
        raise ValueError(
            f"Activation {act_fn_name!r} is not supported in a gated MLP; "
            f"supported: {sorted(_ACT_AND_MUL)}"
        )
    return _ACT_AND_MUL[name]()
