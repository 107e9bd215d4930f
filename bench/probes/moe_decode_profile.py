"""Where the MoE decode pair's fixed cost goes: torch.profiler over eager calls of the layer
(router, sort, gate_up kernel, down kernel) at small M on Mixtral-8x7B and Qwen3-30B-A3B shapes,
bf16 (router logits too, as the engine's router GEMM writes them), printing each CUDA kernel's
mean time next to the routed experts' weight-read floor.

    PYORCH_PDL=0 python bench/probes/moe_decode_profile.py [--tokens 1,2,8] [--iters 20]

Run it with PDL off for kernel durations: under PDL a kernel starts before the one ahead of it
ends and waits inside (griddepcontrol.wait), and the profiler counts that wait as its time
(topk_softmax showed 29 us at Mixtral M = 1 that way).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pyorch.benchmarks.attention import copy_bandwidth
from pyorch.layers.fused_moe import fused_moe as fm

SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3_moe": (128, 8, 2048, 768)}


def _profile(model: str, m: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
             bandwidth: float, iters: int) -> None:
    e, _, h = w13.shape
    i = w2.shape[2]
    x = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    logits = torch.randn(m, e, device="cuda").to(torch.bfloat16)

    def layer() -> torch.Tensor:
        w, ids = fm.fused_topk(logits, top_k, True)
        return fm.fused_experts_decode(x, w13, w2, w, ids, e)

    for _ in range(3):
        layer()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            layer()
        torch.cuda.synchronize()
    _, ids = fm.fused_topk(logits, top_k, True)
    active = int(torch.unique(ids).numel())
    floor = active * 3 * h * i * 2 / bandwidth * 1e6
    print(f"== {model} M={m}: {active} experts, floor {floor:.1f} us (gate_up "
          f"{floor * 2 / 3:.1f}, down {floor / 3:.1f})")
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            print(f"  {evt.device_time_total / iters:8.1f} us/call  x{evt.count // iters}  "
                  f"{evt.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,8")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    for model, (e, k, h, i) in SHAPES.items():
        w13 = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, device="cuda") / i**0.5).to(torch.bfloat16)
        for m in (int(t) for t in args.tokens.split(",")):
            _profile(model, m, w13, w2, k, bandwidth, args.iters)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
