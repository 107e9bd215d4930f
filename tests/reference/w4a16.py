"""4-bit weight formats as checkpoints store them, and their float64 dequantization.

GPTQ (AutoGPTQ / GPTQModel "gptq" v1 format) for a linear layer with weight [N, K]
(out_features, in_features):
  qweight [K / 8, N] int32: row k's code in bits 4 (k % 8) of qweight[k // 8, n].
  qzeros [G, N / 8] int32: column n's zero point MINUS ONE in bits 4 (n % 8) of qzeros[g, n // 8]
    (v1's off-by-one; symmetric 4-bit stores 7 for z = 8).
  scales [G, N] float16, g_idx [K] int32 (row k's group; k // group_size without act-order).
  W[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]; the layer computes x @ W.
AWQ (AutoAWQ "gemm" version) for the same layer:
  qweight [K, N / 8] int32: column 8 c + ORDER[i] in bits 4 i of qweight[k, c], ORDER =
    [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [G, N / 8] the same way (no off-by-one); scales [G, N].
  W[k, n] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n].
"""

from dataclasses import dataclass

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes [K, N] (0..15) -> [K / 8, N] int32, row 8 r + i in bits 4 i (GPTQ's qweight)."""
    k, n = codes.shape
    c = codes.to(torch.int64).view(k // 8, 8, n)
    packed = torch.zeros(k // 8, n, dtype=torch.int64, device=codes.device)
    for i in range(8):
        packed |= c[:, i, :] << (4 * i)
    return _to_int32(packed)


def pack_cols(codes: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """codes [R, N] (0..15) -> [R, N / 8] int32: column 8 c + order[i] in bits 4 i (plain order
    when order is None: GPTQ's qzeros; AWQ_ORDER: AutoAWQ's qweight and qzeros)."""
    r, n = codes.shape
    c = codes.to(torch.int64).view(r, n // 8, 8)
    order = order or list(range(8))
    packed = torch.zeros(r, n // 8, dtype=torch.int64, device=codes.device)
    for i in range(8):
        packed |= c[:, :, order[i]] << (4 * i)
    return _to_int32(packed)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], 1).reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    p = packed.to(torch.int64) & 0xFFFFFFFF
    order = order or list(range(8))
    out = torch.empty(packed.shape[0], packed.shape[1], 8, dtype=torch.int64,
                      device=packed.device)
    for i in range(8):
        out[:, :, order[i]] = (p >> (4 * i)) & 0xF
    return out.view(packed.shape[0], -1)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


@dataclass
class Quantized:
    """Codes, zero points and scales of one [K, N] weight, with groups along K."""

    codes: torch.Tensor  # [K, N] int64, 0..15
    zeros: torch.Tensor  # [G, N] int64, 0..15
    scales: torch.Tensor  # [G, N] float
    g_idx: torch.Tensor  # [K] int32: row k's group

    def dequantize(self) -> torch.Tensor:
        """[K, N] float64."""
        g = self.g_idx.long()
        return (self.codes - self.zeros[g]).double() * self.scales.double()[g]


def quantize(
    weight: torch.Tensor,  # [N, K] float, nn.Linear's layout
    group_size: int,
    sym: bool,
    act_order: bool = False,
    generator: torch.Generator | None = None,
    order: torch.Tensor | None = None,
) -> Quantized:
    """Round-to-nearest 4-bit quantization with groups of group_size rows of K (-1: one group).
    act_order: groups are formed over a random permutation of K (as GPTQ's desc_act forms them
    over the Hessian order), so g_idx is not monotonic; `order` gives that permutation. Scales
    are rounded to float16 first, as checkpoints store them."""
    w = weight.double().t().contiguous()  # [K, N]
    k, n = w.shape
    gs = k if group_size == -1 else group_size
    if order is None:
        order = torch.randperm(k, generator=generator) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    num_groups = k // gs
    codes = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    scales = torch.empty(num_groups, n, dtype=torch.float64)
    for g in range(num_groups):
        rows = order[g * gs:(g + 1) * gs]
        wg = w[rows]
        if sym:
            s = (wg.abs().amax(0) / 7.5).clamp_min(1e-8).half().double()
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(0).clamp_max(0), wg.amax(0).clamp_min(0)
            s = ((hi - lo) / 15).clamp_min(1e-8).half().double()
            z = torch.round(-lo / s).clamp(0, 15).long()
        codes[rows] = torch.round(wg / s + z).clamp(0, 15).long()
        zeros[g], scales[g] = z, s
    return Quantized(codes, zeros, scales.half(), g_idx)


def gptq_tensors(q: Quantized, act_order: bool) -> dict[str, torch.Tensor]:
    """The tensors a "gptq" (v1) checkpoint stores for one layer (AutoGPTQ's names)."""
    k = q.codes.shape[0]
    g_idx = q.g_idx if act_order else torch.arange(k, dtype=torch.int32, device=q.g_idx.device) // (
        k // q.scales.shape[0])
    return {
        "qweight": pack_rows(q.codes),
        "qzeros": pack_cols(q.zeros - 1),  # v1's off-by-one (7 for a symmetric 8)
        "scales": q.scales.half(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    """The tensors an AutoAWQ "gemm" checkpoint stores for one layer."""
    return {
        "qweight": pack_cols(q.codes, AWQ_ORDER),
        "qzeros": pack_cols(q.zeros, AWQ_ORDER),
        "scales": q.scales.half(),
    }


def random_quantized(
    k: int, n: int, group_size: int, zero_points: bool, act_order: bool = False,
    generator: torch.Generator | None = None, device: str = "cpu",
) -> Quantized:
    """Fresh random codes, zero points (8 without) and scales ~ 1/sqrt(K) (outputs O(1)), made on
    `device` (the generator's, when given)."""
    gs = k if group_size == -1 else group_size
    num_groups = k // gs
    kw = dict(generator=generator, device=device)
    codes = torch.randint(0, 16, (k, n), **kw)  # type: ignore[call-overload]
    zeros = (torch.randint(0, 16, (num_groups, n), **kw) if zero_points  # type: ignore[call-overload]
             else torch.full((num_groups, n), 8, dtype=torch.int64, device=device))
    scales = (torch.rand(num_groups, n, **kw) + 0.5) * (k ** -0.5) / 4  # type: ignore[call-overload]
    order = (torch.randperm(k, **kw) if act_order  # type: ignore[call-overload]
             else torch.arange(k, device=device))
    g_idx = torch.empty(k, dtype=torch.int32, device=device)
    g_idx[order] = (torch.arange(k, device=device) // gs).to(torch.int32)
    return Quantized(codes, zeros, scales.half().double(), g_idx)
