"""cuBLAS at large M on Llama-3-8B's linear shapes: TFLOP/s of F.linear per shape and row count,
with torch's cuBLAS and cuBLASLt back ends, against the bf16 matmul ceiling measured in the same
run (8192^3). A developer's probe for the throughput workloads' GEMMs (decode at batch ~1000,
16k-token prefill): which shapes lose to wave quantization or tile choice.

    python bench/probes/gemm_large_m.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pyorch.benchmarks.attention import event_times

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = [256, 512, 768, 992, 1000, 1008, 1024, 1040, 2048, 16384]


def time_ms(fn, iters: int = 20) -> float:
    """Milliseconds per call: the best of 3 timed batches of `iters` back-to-back calls."""
    def batch() -> None:
        for _ in range(iters):
            fn()

    return min(event_times(batch, 3, warmup=1)) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    big = torch.randn(8192, 8192, device=dev, dtype=dt)
    ceiling = 2 * 8192**3 / time_ms(lambda: big @ big) / 1e9
    print(f"matmul 8192^3: {ceiling:.0f} TFLOP/s (the ceiling below)")
    rows = []
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            for m in ROWS:
                if name == "lm_head" and m > 2048:
                    continue
                x = torch.randn(m, k, device=dev, dtype=dt)
                ms = time_ms(lambda: F.linear(x, w))
                tflops = 2 * m * n * k / ms / 1e9
                rows.append({"backend": backend, "shape": name, "m": m, "n": n, "k": k,
                             "ms": ms, "tflops": tflops, "of_ceiling": tflops / ceiling})
                print(f"{backend:8s} {name:12s} M={m:5d}: {ms * 1e3:8.1f} us "
                      f"{tflops:6.0f} TFLOP/s ({tflops / ceiling:.2f} of the ceiling)")
    torch.backends.cuda.preferred_blas_library("default")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling_tflops": ceiling, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
