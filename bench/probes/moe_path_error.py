"""Whether the CUDA MoE expert paths differ in accuracy: the CUTLASS grouped GEMMs
(fused_experts_grouped) and the mma.sync pair (fused_moe_gemm) against a float64 reference that
rounds the SiLU-and-mul activation to bf16 as every bf16 MoE does, on the tiny test models' shapes
and Qwen3-30B-A3B's, at batch sizes 1..164. Prints each path's max error relative to the
reference's max |output|.

    python bench/probes/moe_path_error.py   (CUDA, a build with the CUTLASS grouped GEMM)
"""

import torch
import torch.nn.functional as F

from pyorch import _ops
from pyorch.layers.fused_moe import fused_moe as fm

# (experts, hidden, intermediate, top_k): tiny Qwen3-MoE, tiny Mixtral, Qwen3-30B-A3B
SHAPES = [(8, 128, 64, 3), (6, 128, 256, 2), (128, 2048, 768, 8)]
TOKENS = [1, 2, 3, 5, 6, 8, 16, 33, 64, 164]


def reference(x, w13, w2, weights, ids, inter):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            gate_up = w13[e].double() @ x[t].double()
            act = (F.silu(gate_up[:inter]) * gate_up[inter:]).bfloat16().double()
            out[t] += weights[t, j].double() * (w2[e].double() @ act)
    return out


def fused_moe_gemm_path(x, w13, w2, weights, ids, experts):
    """fused_experts with its other two paths switched off: the mma.sync fused_moe_gemm pair."""
    saved = fm._use_grouped_gemm, fm.moe_decode_block_size
    fm._use_grouped_gemm, fm.moe_decode_block_size = (lambda *a: False), (lambda *a: None)
    try:
        return fm.fused_experts(x, w13, w2, weights, ids, experts)
    finally:
        fm._use_grouped_gemm, fm.moe_decode_block_size = saved


def main() -> None:
    assert _ops.moe_grouped_gemm_available(), "needs a CUDA build with the CUTLASS grouped GEMM"
    torch.manual_seed(0)
    for experts, hidden, inter, top_k in SHAPES:
        w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.1).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device="cuda") * 0.1).bfloat16()
        for m in TOKENS:
            x = torch.randn(m, hidden, device="cuda").bfloat16()
            weights, ids = fm.fused_topk(torch.randn(m, experts, device="cuda"), top_k, True)
            ref = reference(x, w13, w2, weights, ids, inter)
            scale = ref.abs().max().item()
            grouped = fm.fused_experts_grouped(x, w13, w2, weights, ids, experts).double()
            mma = fused_moe_gemm_path(x, w13, w2, weights, ids, experts).double()
            print(f"E{experts} H{hidden} I{inter} K{top_k} M{m}: grouped err "
                  f"{(grouped - ref).abs().max().item() / scale:.4f} fused_moe_gemm err "
                  f"{(mma - ref).abs().max().item() / scale:.4f}", flush=True)


if __name__ == "__main__":
    main()
