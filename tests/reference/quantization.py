"""Reference quantization in float64 (vLLM's semantics): each arithmetic step is done in float64
and rounded to float32 where the op's contract computes in float32, so the results are the exact
values a correctly rounded fp32 kernel must produce; fp8 rounding is torch's (round to nearest
even) after clamping to +-448, int8 rounding is round-half-to-even with saturation."""

from typing import Optional

import torch

FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def f32(x: torch.Tensor) -> torch.Tensor:
    """Rounds a float64 tensor to float32 and back (one correctly rounded fp32 operation)."""
    return x.double().to(torch.float32).double()


def to_fp8(values: torch.Tensor, lo: float = -FP8_MAX, hi: float = FP8_MAX) -> torch.Tensor:
    return f32(values).clamp(lo, hi).to(torch.float32).to(torch.float8_e4m3fn)


def to_int8(values: torch.Tensor) -> torch.Tensor:
    return torch.round(f32(values)).clamp(-128, 127).to(torch.int8)


def fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H] / scale ([1] or [T, 1]) -> float8_e4m3fn."""
    return to_fp8(x.double() / scale.double())


def dynamic_fp8_scale(x: torch.Tensor) -> torch.Tensor:
    return f32(torch.clamp(f32(x.double().abs().max() / FP8_MAX), min=FP8_MIN_SCALE)).reshape(1)


def per_token_fp8_scales(x: torch.Tensor, scale_ub: Optional[float] = None) -> torch.Tensor:
    absmax = x.double().abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        absmax = absmax.clamp(max=scale_ub)
    return f32(torch.clamp(f32(absmax / FP8_MAX), min=FP8_MIN_SCALE))


def static_int8(x: torch.Tensor, scale: float, azp: Optional[int]) -> torch.Tensor:
    q = torch.round(f32(x.double() / f32(torch.tensor(scale, dtype=torch.float64))))
    if azp is not None:
        q = q + azp
    return q.clamp(-128, 127).to(torch.int8)


def dynamic_int8_symmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = x.double().abs().amax(dim=-1, keepdim=True)
    scales = f32(absmax / 127.0)
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), f32(127.0 / absmax))
    return to_int8(x.double() * inv), scales


def dynamic_int8_asymmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xd = x.double()
    lo, hi = xd.amin(dim=-1, keepdim=True), xd.amax(dim=-1, keepdim=True)
    same = lo == hi
    lo, hi = torch.where(same, lo.clamp(max=0), lo), torch.where(same, hi.clamp(min=0), hi)
    scales = f32(f32(hi - lo) / 255.0)
    azp = torch.round(f32(-128.0 - f32(lo / scales)))
    q = (torch.round(f32(xd / scales)) + azp).clamp(-128, 127)
    zero = scales == 0
    return (torch.where(zero, torch.zeros_like(q), q).to(torch.int8), scales,
            torch.where(zero, torch.zeros_like(azp), azp).to(torch.int32))


def per_token_group_fp8(
    x: torch.Tensor, group_size: int, eps: float, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scales [M, K / group_size] float32)."""
    m, k = x.shape
    groups = x.double().reshape(m, k // group_size, group_size)
    absmax = groups.abs().amax(dim=-1).clamp(min=f32(torch.tensor(eps)).item())
    scales = f32(absmax / FP8_MAX)
    if ue8m0:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = to_fp8(groups / scales.unsqueeze(-1)).reshape(m, k)
    return q, scales.float()


def scaled_mm(
    a: torch.Tensor,  # [M, K] fp8 / int8
    b: torch.Tensor,  # [K, N]
    scale_a: torch.Tensor,  # [1] / [M, 1] / [M, K/128] (block)
    scale_b: torch.Tensor,  # [1] / [N] / [K/128, N/128] (block)
    bias: Optional[torch.Tensor] = None,
    block: bool = False,
) -> torch.Tensor:  # [M, N] float64
    ad, bd = a.double(), b.double()
    m, k = a.shape
    n = b.shape[1]
    if block:
        sa = scale_a.double().repeat_interleave(128, dim=1)[:, :k]
        sb = scale_b.double().repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
        out = (ad * sa) @ (bd * sb)
    else:
        sa = scale_a.double().reshape(-1, 1) if scale_a.numel() > 1 else scale_a.double()
        sb = scale_b.double().reshape(1, -1) if scale_b.numel() > 1 else scale_b.double()
        out = (ad @ bd) * sa * sb
    if bias is not None:
        out = out + bias.double()
    return out
