"""Where the MoE decode kernel pair stops paying: pyorch's MoE layer at small M through the decode
pair (`fused_experts_decode`) and through the path fused_experts takes past the decode range
(the grouped expert GEMMs: mma.sync below 64 tokens, the CUTLASS grouped path from 64 where it
is built), router and sort included, on Mixtral-8x7B and Qwen3-30B-A3B layer shapes, bf16,
random weights and router logits. Each call is timed inside a CUDA graph (as the engine runs it).
Prints one line per (model, M) with both times, the ratio, and the weight-read floor (the routed
experts' bytes at the measured copy bandwidth), and the largest M where the decode pair is faster
(what the dispatch in fused_moe.py should encode).

    python bench/moe_crossover.py [--models mixtral,qwen3_moe] [--tokens 1,2,4,...,128] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from pyorch.benchmarks import common
from pyorch.benchmarks.attention import copy_bandwidth, graph_ms
from pyorch.layers.fused_moe import fused_moe as fm

# name -> (num_experts, top_k, hidden_size, moe_intermediate_size)
SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3_moe": (128, 8, 2048, 768)}


def _row(model: str, m: int, bandwidth: float, iters: int) -> dict[str, Any]:
    num_experts, top_k, hidden, inter = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, num_experts, device="cuda", generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
           / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
          / inter**0.5).to(torch.bfloat16)
    _, ids = fm.fused_topk(logits, top_k, True)
    active = int(torch.unique(ids).numel())

    def decode() -> torch.Tensor:
        w, i = fm.fused_topk(logits, top_k, True)
        return fm.fused_experts_decode(x, w13, w2, w, i, num_experts)

    def other() -> torch.Tensor:  # fused_experts with the decode range switched off
        limit = fm.MOE_DECODE_MAX_TOKENS
        fm.MOE_DECODE_MAX_TOKENS = 0
        try:
            w, i = fm.fused_topk(logits, top_k, True)
            return fm.fused_experts(x, w13, w2, w, i, num_experts)
        finally:
            fm.MOE_DECODE_MAX_TOKENS = limit

    a, b = decode().float(), other().float()
    row: dict[str, Any] = dict(model=model, M=m, active_experts=active,
                               floor_us=active * 3 * hidden * inter * 2 / bandwidth * 1e6,
                               max_rel_diff=float((a - b).abs().max() / b.abs().max()))
    row["decode_us"] = graph_ms(decode, iters) * 1e3
    row["grouped_us"] = graph_ms(other, iters) * 1e3
    row["grouped_over_decode"] = row["grouped_us"] / row["decode_us"]
    row["decode_over_floor"] = row["decode_us"] / row["floor_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen3_moe")
    parser.add_argument("--tokens", default="1,2,4,8,16,24,32,48,64,96,128")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<GPU>/)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for model in args.models.split(","):
        for m in (int(t) for t in args.tokens.split(",")):
            row = _row(model, m, bandwidth, args.iters)
            torch.cuda.empty_cache()
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
        wins = [r["M"] for r in rows if r["model"] == model and r["grouped_over_decode"] > 1]
        print(f"{model}: the decode pair is faster up to M = {max(wins) if wins else 0} "
              f"(MOE_DECODE_MAX_TOKENS = {fm.MOE_DECODE_MAX_TOKENS})")
    out = args.out or os.path.join(common.results_dir("cuda"), "moe_crossover.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=common.device_name("cuda"), torch=torch.__version__,
                       copy_bandwidth_GBps=bandwidth / 1e9, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
