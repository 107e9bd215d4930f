"""The decode layer's GEMM chain, fused (skinny_gemm_fused) against unfused (rms_norm /
fused_add_rms_norm, skinny_gemm, silu_and_mul), each replayed in a CUDA graph over 32 layers of
their own Llama-3-8B-shaped bf16 weights (no layer's weight is in L2 when it runs):

    python bench/probes/skinny_fused.py [--tokens 1 8] [--out OUT.json]

Per layer, unfused: fused_add_rms_norm, qkv GEMM, fused_add_rms_norm, gate_up GEMM, silu_and_mul,
down GEMM, and o_proj's GEMM (its input stands in for attention's output); fused: qkv with the
norm, o_proj with the add, gate_up with the norm and SiLU, down with the add. Also each GEMM
alone (plain against its fused form), so that a slow form shows by itself. Prints ms per
32-layer chain and the ratio fused / unfused, and the weight-read floor at the in-run copy
bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from pyorch import _ops
from pyorch.benchmarks.attention import copy_bandwidth, event_times
from pyorch.benchmarks.common import median

HIDDEN, INTER, QKV, LAYERS, EPS = 4096, 14336, 6144, 32, 1e-5


def _time_graph(fn, iters: int = 20) -> float:
    """Median ms of one replay of a graph of fn (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median(event_times(graph.replay, iters, warmup=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev, bf = "cuda", torch.bfloat16

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) * k**-0.5).to(bf)

    layers = [dict(qkv=weight(QKV, HIDDEN), o=weight(HIDDEN, HIDDEN),
                   gate_up=weight(2 * INTER, HIDDEN), down=weight(HIDDEN, INTER),
                   g1=(torch.rand(HIDDEN, device=dev) + 0.5).to(bf),
                   g2=(torch.rand(HIDDEN, device=dev) + 0.5).to(bf)) for _ in range(LAYERS)]
    weight_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    copy_bw = copy_bandwidth()
    floor_ms = weight_bytes / copy_bw * 1e3  # every weight byte read once at the copy's rate
    rows = []
    for m in args.tokens:
        x = (torch.randn(m, HIDDEN, device=dev) * 4).to(bf)
        residual, hidden = x.clone(), torch.empty_like(x)
        attn = torch.randn(m, HIDDEN, device=dev, dtype=bf)
        qkv = torch.empty(m, QKV, device=dev, dtype=bf)
        gate_up = torch.empty(m, 2 * INTER, device=dev, dtype=bf)
        act = torch.empty(m, INTER, device=dev, dtype=bf)

        def unfused() -> None:
            hidden.copy_(x)
            residual.zero_()
            for w in layers:
                _ops.fused_add_rms_norm(hidden, residual, w["g1"], EPS)
                _ops.skinny_gemm(qkv, hidden, w["qkv"], None)
                _ops.skinny_gemm(hidden, attn, w["o"], None)
                _ops.fused_add_rms_norm(hidden, residual, w["g2"], EPS)
                _ops.skinny_gemm(gate_up, hidden, w["gate_up"], None)
                _ops.silu_and_mul(act, gate_up)
                _ops.skinny_gemm(hidden, act, w["down"], None)

        def fused() -> None:
            residual.copy_(x)
            for w in layers:
                _ops.skinny_gemm_fused(qkv, residual, w["qkv"], None, w["g1"], EPS, "store")
                _ops.skinny_gemm_fused(residual, attn, w["o"], None, None, EPS, "add")
                _ops.skinny_gemm_fused(act, residual, w["gate_up"], None, w["g2"], EPS,
                                       "silu_and_mul")
                _ops.skinny_gemm_fused(residual, act, w["down"], None, None, EPS, "add")

        singles = {
            "qkv plain": lambda: [_ops.skinny_gemm(qkv, x, w["qkv"], None) for w in layers],
            "qkv norm": lambda: [_ops.skinny_gemm_fused(qkv, x, w["qkv"], None, w["g1"], EPS,
                                                        "store") for w in layers],
            "gate_up plain": lambda: [_ops.skinny_gemm(gate_up, x, w["gate_up"], None)
                                      for w in layers],
            "gate_up silu": lambda: [_ops.skinny_gemm_fused(act, x, w["gate_up"], None, None,
                                                            EPS, "silu_and_mul") for w in layers],
            "gate_up norm+silu": lambda: [_ops.skinny_gemm_fused(act, x, w["gate_up"], None,
                                                                 w["g2"], EPS, "silu_and_mul")
                                          for w in layers],
            "down plain": lambda: [_ops.skinny_gemm(hidden, act, w["down"], None)
                                   for w in layers],
            "down add": lambda: [_ops.skinny_gemm_fused(residual, act, w["down"], None, None, EPS,
                                                        "add") for w in layers],
        }
        row = dict(tokens=m, unfused_ms=_time_graph(unfused), fused_ms=_time_graph(fused))
        row["ratio_fused_to_unfused"] = row["fused_ms"] / row["unfused_ms"]
        row["singles_ms_per_32"] = {name: _time_graph(fn) for name, fn in singles.items()}
        rows.append(row)
        print(f"M={m}: chain unfused {row['unfused_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms "
              f"({row['ratio_fused_to_unfused']:.3f}x); weight-read floor {floor_ms:.3f} ms")
        for name, ms in row["singles_ms_per_32"].items():
            print(f"    {name:20s} {ms * 1e3 / LAYERS:8.2f} us per GEMM")
    result = dict(gpu=torch.cuda.get_device_name(), copy_bandwidth_gbs=copy_bw / 1e9,
                  weight_read_floor_ms=floor_ms, rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
