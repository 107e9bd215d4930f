"""The MoE layer alone (router top-k softmax + the two grouped expert GEMMs + the top-k sum) on
Mixtral-8x7B and Qwen3-30B-A3B layer shapes, pyorch against vLLM's fused_moe side by side when
vLLM imports, bf16, random weights and router logits. Prints one line per (model, M) with both
times, their ratio (vLLM / pyorch: > 1 means pyorch is faster), and the weight-read floor: the
bytes of the experts the batch actually routes to, at the measured device copy bandwidth (bytes
read + written per second, about what a pure read stream reaches). Each layer call is timed
inside a CUDA graph (as the engine runs it: no host launch overhead) and, separately, eagerly.

    python bench/moe.py [--models mixtral,qwen3_moe] [--tokens 1,8,64,512,4096,16384] [--out F]

Writes JSON to bench/results/<GPU>/moe.json unless --out says otherwise. Also checks that the two
engines' outputs agree (max abs difference, relative to the output's max).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch

from pyorch.benchmarks import common
from pyorch.benchmarks.attention import copy_bandwidth, event_times
from pyorch.layers.fused_moe import fused_experts, fused_topk

# name -> (num_experts, top_k, hidden_size, moe_intermediate_size, renormalize)
SHAPES = {
    "mixtral": (8, 2, 4096, 14336, True),
    "qwen3_moe": (128, 8, 2048, 768, True),
}


def _vllm_moe() -> Callable[..., torch.Tensor] | None:
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts as v_experts
        from vllm.model_executor.layers.fused_moe import fused_topk as v_topk
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"vLLM fused_moe not importable ({type(e).__name__}: {e}); pyorch only")
        return None

    def run(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor:
        weights, ids, *_ = v_topk(x, logits, top_k, renormalize)
        return v_experts(x, w13, w2, weights, ids)

    return run


def _pyorch_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                top_k: int, renormalize: bool) -> torch.Tensor:
    weights, ids = fused_topk(logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, w13.shape[0])


def _graph_ms(fn: Callable[[], Any], iters: int) -> float:
    """Median ms of one replay of a CUDA graph holding one call of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return common.median(event_times(graph.replay, iters))


def _time(row: dict[str, Any], name: str, fn: Callable[[], Any], iters: int) -> None:
    row[f"{name}_eager_us"] = common.median(event_times(fn, iters)) * 1e3
    try:
        row[f"{name}_us"] = _graph_ms(fn, iters) * 1e3
    except RuntimeError as e:  # a path that cannot be captured: report the eager time
        print(f"{name}: CUDA graph capture failed ({e}); graph time = eager time")
        row[f"{name}_us"] = row[f"{name}_eager_us"]


def _row(model: str, m: int, bandwidth: float, vllm: Callable[..., torch.Tensor] | None,
         iters: int) -> dict[str, Any]:
    num_experts, top_k, hidden, inter, renorm = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, num_experts, device="cuda", generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
           / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
          / inter**0.5).to(torch.bfloat16)
    _, ids = fused_topk(logits, top_k, renorm)
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * hidden * inter * 2
    row: dict[str, Any] = dict(op="fused_moe", model=model, M=m, num_experts=num_experts,
                               top_k=top_k, hidden=hidden, intermediate=inter,
                               active_experts=active,
                               floor_us=weight_bytes / bandwidth * 1e6)
    ours = _pyorch_moe(x, logits, w13, w2, top_k, renorm)
    _time(row, "pyorch", lambda: _pyorch_moe(x, logits, w13, w2, top_k, renorm), iters)
    if vllm is not None:
        v = vllm
        theirs = v(x, logits, w13, w2, top_k, renorm)
        scale = theirs.float().abs().max().clamp_min(1e-6)
        row["max_rel_diff"] = float((ours.float() - theirs.float()).abs().max() / scale)
        _time(row, "vllm", lambda: v(x, logits, w13, w2, top_k, renorm), iters)
        row["ratio"] = row["vllm_us"] / row["pyorch_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen3_moe")
    parser.add_argument("--tokens", default="1,8,64,512,4096,16384")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<GPU>/)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    vllm = None if args.no_vllm else _vllm_moe()
    rows = []
    for model in args.models.split(","):
        for m in (int(t) for t in args.tokens.split(",")):
            row = _row(model, m, bandwidth, vllm, args.iters)
            torch.cuda.empty_cache()  # the previous shape's weights
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    out = args.out or os.path.join(common.results_dir("cuda"), "moe.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=common.device_name("cuda"), torch=torch.__version__,
                       copy_bandwidth_GBps=bandwidth / 1e9, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
