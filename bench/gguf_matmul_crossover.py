"""GGUF products on the GPU for many tokens: our int8-mma `ggml_mul_mat_a8` against the
dequantize + cuBLAS path that `gguf_matmul` takes above MMVQ_MAX_TOKENS tokens
(pyorch/layers/quantization/gguf.py: `dequantize_matmul`), and `ggml_mul_mat_vec_a8` where it
applies, on Llama-3-8B projection shapes; the crossover picks the switch point.

    PYTHONPATH=$PWD python bench/gguf_matmul_crossover.py --json OUT.json

Weights: random block bytes with every fp16 scale field set to uniform +-0.01 (the layout of
bench/cpp/bench_gguf.cu; the kernels' correctness is tests/cuda/gguf's job). Timing: a CUDA graph
of one call per weight copy over enough copies that no call finds its weight in L2, the median
replay over --iters, per call. Activations bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from typing import Any, Callable

import torch

from pyorch import _ops
from pyorch.layers.quantization.gguf import MMVQ_MAX_TOKENS, GGUFShard, dequantize_matmul

# name: (GGML type id, block size, block bytes, byte offsets of the fp16 scale fields)
TYPES = {"Q4_K": (12, 256, 144, (0, 2)), "Q8_0": (8, 32, 34, (0,)),
         "Q6_K": (14, 256, 210, (208,)), "Q4_0": (2, 32, 18, (0,))}
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def random_blocks(rows: int, cols: int, block: int, nbytes: int, offsets: tuple[int, ...],
                  gen: torch.Generator) -> torch.Tensor:
    w = torch.randint(0, 256, (rows, cols // block, nbytes), dtype=torch.uint8, device="cuda",
                      generator=gen)
    for off in offsets:
        d = ((torch.rand(rows, cols // block, device="cuda", generator=gen) * 2 - 1) * 0.01)
        w[:, :, off:off + 2] = d.half().view(torch.uint8).reshape(rows, cols // block, 2)
    return w.reshape(rows, -1).contiguous()


def time_us(fn: Callable[[int], Any], copies: int, iters: int) -> float:
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(0)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(copies):
                fn(i)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def bench_shape(tname: str, sname: str, tokens: list[int], iters: int,
                gen: torch.Generator) -> list[dict[str, Any]]:
    qtype, block, nbytes, offsets = TYPES[tname]
    n, k = SHAPES[sname]
    size = n * (k // block) * nbytes
    copies = max(2, int(256e6 // size) + 1)
    weights = [random_blocks(n, k, block, nbytes, offsets, gen) for _ in range(copies)]
    shards = [GGUFShard(w, qtype, n, k) for w in weights]

    def mmq(i: int, x: torch.Tensor) -> torch.Tensor:
        return _ops.ggml_mul_mat_a8(weights[i], x, qtype, n)

    def mmvq(i: int, x: torch.Tensor) -> torch.Tensor:
        return _ops.ggml_mul_mat_vec_a8(weights[i], x, qtype, n)

    def dequant(i: int, x: torch.Tensor) -> torch.Tensor:
        return dequantize_matmul(x, shards[i])

    rows = []
    for m in tokens:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        row: dict[str, Any] = dict(type=tname, shape=sname, m=m, n=n, k=k, weight_MB=size / 1e6)
        row["mmq_us"] = time_us(partial(mmq, x=x), copies, iters)
        row["dequant_cublas_us"] = time_us(partial(dequant, x=x), copies, iters)
        if m <= MMVQ_MAX_TOKENS:
            row["mmvq_us"] = time_us(partial(mmvq, x=x), copies, iters)
        row["dequant_over_mmq"] = row["dequant_cublas_us"] / row["mmq_us"]
        rows.append(row)
        print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--types", default="Q4_K,Q8_0")
    p.add_argument("--shapes", default="qkv_proj,o_proj,gate_up,down")
    p.add_argument("--tokens", default="8,9,12,16,24,32,64,128,512")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[dict[str, Any]] = []
    for tname in args.types.split(","):
        for sname in args.shapes.split(","):
            rows += bench_shape(tname, sname, tokens, args.iters, gen)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
