"""torch SDPA (flash backend) on the shapes of `bench_paged_attention --mode prefill`: causal
self-attention of whole prompts, GQA, contiguous K/V, TFLOP/s counting 4 * q * k * d / 2 per head
(the causal half), the median of CUDA-event timings after warm-up. The baseline that the prefill
kernel's rows are compared with in the same device run.

    python bench/sdpa_prefill.py --batch 1,1,4 --context 4096,8192,2048 --head-size 128
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pyorch.benchmarks import common
from pyorch.benchmarks.attention import event_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,1,4")
    parser.add_argument("--context", default="4096,8192,2048")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    torch.manual_seed(0)
    h, hk, d = args.num_heads, args.num_kv_heads, args.head_size
    for b, n in zip(batches, contexts):
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = event_times(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True), 20, warmup=3)
        us = common.median(ms) * 1e3
        flops = 4.0 * b * h * n * n * d / 2
        print(f"op=torch_sdpa_flash torch={torch.__version__} batch={b} context={n} "
              f"head_size={d} time_us={us:.2f} TFLOP/s={flops / (us * 1e6):.1f}")


if __name__ == "__main__":
    main()
