"""Reference gated activations: out[..., d] = act(x[..., :d]) * x[..., d:].

Two references: `native` is vLLM's forward_native (torch in the input dtype, which rounds the
activation and then the product), the definition the ops are held to; `exact` is the float64 value
rounded once, which is what the ops compute up to fp32 error.
"""

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu_and_mul": F.silu,
    "gelu_and_mul": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh_and_mul": lambda x: F.gelu(x, approximate="tanh"),
}


def native(op: str, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return ACTIVATIONS[op](x[..., :d]) * x[..., d:]


def exact(op: str, x: torch.Tensor) -> torch.Tensor:
    return native(op, x.double()).to(x.dtype)
