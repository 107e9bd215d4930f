"""CPU GGUF products on one layer's weight: the repacked kernel (`ggml_mul_mat_repacked_a8`, what
the engine runs for every quantized type) against the
file-layout kernel (`ggml_mul_mat_vec_a8` up to 8 tokens, `ggml_mul_mat_a8` above) and against
float32 `F.linear` on the dequantized weight, in one run, at 1 and 16 tokens. A type without a
repacked kernel would get file-layout rows only (against F.linear).

Shapes: the default model's (SmolLM2-135M: hidden 576, intermediate 1536, vocabulary 49152) and
Llama-3-8B's (4096 / 14336). Weights are random GGUF blocks (tests/reference/gguf.make_weight).
A shape whose weight fits the caches is timed warm: the figures are the kernels' compute rates,
not a decode step's (a step streams every layer's weight from memory; bench/gguf_cpu.py times
those). Prints each time, the speedups, and the weight bytes per second; writes JSON.

    python bench/gguf_cpu_kernels.py [--threads 2] [--output-json bench/results/cpu/gguf_cpu_kernels.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyorch import _C, _ops  # noqa: E402
from pyorch.benchmarks.common import environment, write_json  # noqa: E402
from pyorch.layers.quantization.gguf import can_repack, repack_blocks  # noqa: E402
from tests.reference import gguf as ref  # noqa: E402

# (name, type, rows, cols)
SHAPES = [
    ("smollm2 gate_up", Q.Q4_1, 3072, 576),
    ("smollm2 down", Q.Q4_1, 576, 1536),
    ("smollm2 lm_head", Q.Q8_0, 49152, 576),
    ("llama3-8b qkv", Q.Q4_0, 6144, 4096),
    ("llama3-8b qkv", Q.Q5_0, 6144, 4096),
    ("llama3-8b qkv", Q.Q4_K, 6144, 4096),
    ("llama3-8b down", Q.Q4_K, 4096, 14336),
    ("llama3-8b down", Q.Q5_K, 4096, 14336),
    ("llama3-8b down", Q.Q6_K, 4096, 14336),
    ("llama3-8b o", Q.Q8_0, 4096, 4096),
    ("llama3-8b qkv", Q.Q3_K, 6144, 4096),
    ("llama3-8b qkv", Q.Q2_K, 6144, 4096),
]
TOKENS = [1, 16]


def _time(fn: Callable[[], Any], min_s: float = 0.3) -> float:
    """Median of 5 batches of calls, microseconds per call."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    n = max(3, int(min_s / 5 / once))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return float(np.median(runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json", default="bench/results/cpu/gguf_cpu_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows_out: list[dict[str, Any]] = []
    print(f"{'shape':18s} {'type':5s} {'tok':>3s} {'repacked us':>12s} {'file us':>9s} "
          f"{'fp32 us':>9s} {'vs file':>8s} {'vs fp32':>8s} {'GB/s':>6s}")
    for name, qtype, rows, cols in SHAPES:
        raw = ref.make_weight(qtype, rows, cols, rng)
        blocks = torch.from_numpy(raw)
        repacked = can_repack(int(qtype), rows, cols)
        packed = repack_blocks(blocks, int(qtype), rows, cols) if repacked else blocks
        w32 = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).reshape(rows, cols)
        for tokens in TOKENS:
            x = torch.randn(tokens, cols)
            file_op = _ops.ggml_mul_mat_vec_a8 if tokens <= 8 else _ops.ggml_mul_mat_a8
            t_file = _time(lambda: file_op(blocks, x, int(qtype), rows))
            t_f32 = _time(lambda: F.linear(x, w32))
            row = {"shape": name, "type": qtype.name, "rows": rows, "cols": cols,
                   "tokens": tokens, "file_layout_us": t_file, "fp32_linear_us": t_f32,
                   "weight_bytes": int(packed.numel())}
            rows_out.append(row)
            if repacked:
                t_rep = _time(lambda: _ops.ggml_mul_mat_repacked_a8(packed, x, int(qtype), rows))
                row.update(repacked_us=t_rep, repacked_vs_file_layout=t_file / t_rep,
                           repacked_vs_fp32=t_f32 / t_rep,
                           repacked_weight_GBps=packed.numel() / t_rep / 1e3)
                print(f"{name:18s} {qtype.name:5s} {tokens:3d} {t_rep:12.1f} {t_file:9.1f} "
                      f"{t_f32:9.1f} {row['repacked_vs_file_layout']:7.2f}x "
                      f"{row['repacked_vs_fp32']:7.2f}x {row['repacked_weight_GBps']:6.1f}")
            else:  # the engine's kernel for this type is the file-layout one
                row.update(file_layout_vs_fp32=t_f32 / t_file,
                           file_layout_weight_GBps=packed.numel() / t_file / 1e3)
                print(f"{name:18s} {qtype.name:5s} {tokens:3d} {'n/a':>12s} {t_file:9.1f} "
                      f"{t_f32:9.1f} {'':8s} {row['file_layout_vs_fp32']:7.2f}x "
                      f"{row['file_layout_weight_GBps']:6.1f} (file layout)")
    doc = {"args": vars(args), "isa": _C.gguf_cpu_isa(),
           "rows": rows_out, "env": environment("cpu")}
    write_json(args.output_json, doc)
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
