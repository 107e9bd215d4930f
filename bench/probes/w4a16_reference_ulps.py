"""Which reference the W4A16 GEMM (gptq_marlin_gemm) matches on CUDA: a @ W with W = (q - z) * s
rounded to the activation dtype, or exact. For each case and row count it counts the elements
outside the test tolerance against each reference and the largest error against the exact one
in ulps of the output dtype. It showed the stream kernel (M <= 16, groups of whole 64-row
k-blocks) within 0.5 ulp of the exact product, which is why tests/cuda/w4a16 uses the exact
reference there.

    python bench/probes/w4a16_reference_ulps.py   (CUDA, from the repository root)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.cuda.w4a16.test_w4a16 as w4  # noqa: E402
from tests.conftest import tol  # noqa: E402

# (K, N, group size, format, dtype): the shapes the failing tests used, a long K, and group 32
# (whose stream kernel keeps the rounded weight).
CASES = [
    (256, 80, -1, "gptq", torch.float16),
    (256, 80, 64, "awq", torch.float16),
    (64, 16, -1, "awq", torch.float16),
    (640, 272, -1, "awq", torch.float16),
    (2240, 16 * 2200, 64, "gptq", torch.bfloat16),
    (640, 272, 32, "awq", torch.float16),
]


def main() -> None:
    torch.manual_seed(0)
    for k, n, group_size, fmt, dtype in CASES:
        args, reference = w4._layer(k, n, group_size, fmt, dtype, "cuda")
        for m in (1, 7, 16, 33):
            outside = {"rounded": 0, "exact": 0}
            worst_ulps = 0.0
            for _ in range(5):
                a = torch.randn(m, k, dtype=dtype, device="cuda")
                out = w4._gemm(a, args, n).double()
                for name, w in (("rounded", reference.rounded), ("exact", reference.exact)):
                    expected = a.double() @ w
                    t = tol(dtype)
                    limit = t["atol"] + t["rtol"] * expected.abs()
                    outside[name] += int(((out - expected).abs() > limit).sum())
                exact = a.double() @ reference.exact
                ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(2**-10)
                worst_ulps = max(worst_ulps, float(((out - exact).abs() / ulp).max()))
            print(f"K={k} N={n} group={group_size} {fmt} {dtype} M={m}: outside tolerance "
                  f"{outside}, worst {worst_ulps:.2f} ulp from the exact product", flush=True)


if __name__ == "__main__":
    main()
