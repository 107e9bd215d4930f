// Benchmark of pyorch::moe_grouped_gemm (the CUTLASS ptr-array grouped expert GEMM of the MoE
// prefill path) against cuBLAS on the same FLOPs: a dense bf16 GEMM of all the routed rows
// [rows, K] x [K, N] with one weight (cublasGemmEx, CUBLAS_COMPUTE_32F), so ratio_vs_cublas =
// cuBLAS time / grouped time says how close the grouped kernel comes to a dense GEMM.
//
// Rows: M tokens x top_k spread evenly over the experts (the balanced routing of a dummy-weight
// model); --skew F gives expert 0 a fraction F of all rows and spreads the rest evenly.
// Shapes (per layer, gate_up then down): mixtral (E=8, k=2, H=4096, I=14336), qwen3_moe (E=128,
// k=8, H=2048, I=768), qwen3_235b (E=128, k=8, H=4096, I=1536).
// Flags: --shapes mixtral,qwen3_moe,qwen3_235b --tokens 64,512,4096,16384 --fp8 (adds fp8 e4m3
//        rows) --skew 0 --iters 20 --json FILE
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#ifdef PYORCH_BENCH_CUBLAS
#include <cublas_v2.h>
#endif

#include "common/bench_util.h"
#include "common/moe_bench_util.h"
#include "pyorch/moe_grouped.h"

namespace {

using pyorch::bench::Args;
using pyorch::bench::Report;
using bf16 = __nv_bfloat16;

using pyorch::bench::kMoeShapes;
using pyorch::bench::MoeShape;

void* device_random(size_t elems, size_t elem_bytes, uint64_t seed) {
  return pyorch::bench::moe_bench_random(elems, elem_bytes, seed);
}

std::vector<int32_t> offsets_for(int64_t rows, int64_t experts, double skew) {
  std::vector<int32_t> off(experts + 1, 0);
  const int64_t first = static_cast<int64_t>(skew * rows);
  const int64_t rest = rows - first;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t share = rest / experts + (e < rest % experts ? 1 : 0) + (e == 0 ? first : 0);
    off[e + 1] = off[e] + static_cast<int32_t>(share);
  }
  return off;
}

}  // namespace

int main(int argc, char** argv) {
  Args args(argc, argv);
  Report report(args);
#ifndef PYORCH_BENCH_CUBLAS
  std::fprintf(stderr, "bench_moe: built without cuBLAS (the comparison); refusing to run\n");
  return 1;
#else
  if (!pyorch::moe_grouped_gemm_available()) {
    std::fprintf(stderr, "bench_moe: pyorch_cuda was built without CUTLASS\n");
    return 1;
  }
  const auto names = args.strs("shapes", {"mixtral", "qwen3_moe", "qwen3_235b"});
  const auto tokens = args.list("tokens", {64, 512, 4096, 16384});
  const bool with_fp8 = args.has("fp8");
  const double skew = std::atof(args.str("skew", "0").c_str());
  const int iters = static_cast<int>(args.num("iters", 20));
  const std::string device = pyorch::bench::device_name();
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(handle, stream);

  for (const MoeShape& s : kMoeShapes) {
    if (std::find(names.begin(), names.end(), s.name) == names.end()) continue;
    // (projection, N, K): gate_up [2I, H], down [H, I]
    const int64_t projs[2][2] = {{2 * s.inter, s.hidden}, {s.hidden, s.inter}};
    for (int pi = 0; pi < 2; ++pi) {
      const int64_t n = projs[pi][0], k = projs[pi][1];
      for (const bool fp8 : {false, true}) {
        if (fp8 && !with_fp8) continue;
        const size_t eb = fp8 ? 1 : 2;
        const pyorch::DType dt = fp8 ? pyorch::DType::kFp8E4M3 : pyorch::DType::kBFloat16;
        void* w = device_random(static_cast<size_t>(s.experts * n * k), eb, 1 + pi);
        float* alpha = nullptr;
        if (fp8) {
          std::vector<float> host(s.experts, 1e-3f);
          BENCH_CHECK(cudaMalloc(&alpha, s.experts * sizeof(float)));
          BENCH_CHECK(
              cudaMemcpy(alpha, host.data(), s.experts * sizeof(float), cudaMemcpyHostToDevice));
        }
        const size_t ws_bytes = pyorch::moe_grouped_gemm_workspace_size(s.experts, dt);
        void* ws = nullptr;
        BENCH_CHECK(cudaMalloc(&ws, ws_bytes));
        for (const int64_t m : tokens) {
          const int64_t rows = m * s.top_k;
          void* a = device_random(static_cast<size_t>(rows * k), eb, 7);
          void* out = nullptr;
          BENCH_CHECK(cudaMalloc(&out, static_cast<size_t>(rows * n) * sizeof(bf16)));
          const std::vector<int32_t> off = offsets_for(rows, s.experts, skew);
          int32_t* d_off = nullptr;
          BENCH_CHECK(cudaMalloc(&d_off, off.size() * sizeof(int32_t)));
          BENCH_CHECK(
              cudaMemcpy(d_off, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
          const double us = pyorch::bench::time_us(
              [&](cudaStream_t st) {
                BENCH_CHECK(pyorch::moe_grouped_gemm(out, a, w, d_off, alpha, dt, rows, s.experts,
                                                     n, k, ws, ws_bytes, st));
              },
              stream, 3, iters);
          // cuBLAS: out^T [N, rows] = W0 [N, K] . A^T (column-major view of the row-major
          // tensors, what F.linear does), bf16 operands (fp8 rows are timed against it too).
          void* a16 = fp8 ? device_random(static_cast<size_t>(rows * k), 2, 7) : a;
          void* w16 = fp8 ? device_random(static_cast<size_t>(n * k), 2, 3) : w;
          const float one = 1.f, zero = 0.f;
          const double cublas_us = pyorch::bench::time_us(
              [&](cudaStream_t) {
                cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                             static_cast<int>(rows), static_cast<int>(k), &one, w16, CUDA_R_16BF,
                             static_cast<int>(k), a16, CUDA_R_16BF, static_cast<int>(k), &zero, out,
                             CUDA_R_16BF, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT);
              },
              stream, 3, iters);
          const double flops = 2.0 * rows * n * k;
          report.add({{"op", fp8 ? "moe_grouped_gemm_fp8" : "moe_grouped_gemm"},
                      {"device", device},
                      {"shape", s.name},
                      {"proj", pi == 0 ? "gate_up" : "down"},
                      {"tokens", std::to_string(m)},
                      {"rows", std::to_string(rows)},
                      {"experts", std::to_string(s.experts)},
                      {"n", std::to_string(n)},
                      {"k", std::to_string(k)},
                      {"skew", Report::fmt(skew, 2)},
                      {"us", Report::fmt(us, 1)},
                      {"tflops", Report::fmt(flops / us * 1e-6, 1)},
                      {"cublas_bf16_us", Report::fmt(cublas_us, 1)},
                      {"cublas_bf16_tflops", Report::fmt(flops / cublas_us * 1e-6, 1)},
                      {"ratio_vs_cublas", Report::fmt(cublas_us / us, 3)}});
          if (fp8) {
            BENCH_CHECK(cudaFree(a16));
            BENCH_CHECK(cudaFree(w16));
          }
          BENCH_CHECK(cudaFree(a));
          BENCH_CHECK(cudaFree(out));
          BENCH_CHECK(cudaFree(d_off));
        }
        BENCH_CHECK(cudaFree(w));
        BENCH_CHECK(cudaFree(ws));
        if (alpha) BENCH_CHECK(cudaFree(alpha));
      }
    }
  }
  cublasDestroy(handle);
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
#endif
}
