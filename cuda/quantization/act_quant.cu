// silu_and_mul + dynamic per-token fp8 quantization in one kernel (pyorch/quantization.h:
// silu_and_mul_dynamic_per_token_fp8_quant), in front of an fp8 down_proj. Before it, an fp8 MLP
// ran act_and_mul_kernel (writing silu(gate) * up in bf16) and then the quantizer (reading it
// back): 2 x 28.7 MB at 1000 rows of Llama-3-8B's 14336, about 27 us a layer on an H200 for the
// quantizer alone. Here the row stays in registers from the gate / up loads to the fp8 store.
// Each element is act_and_mul_kernel's expression (act_fn<kSilu>, fp32 math, rounded to T once)
// and the quantization is fp8_quant_rows_vec_kernel's (the same |x| max, order-free; the same
// scale, division and clamp in store_fp8_row), so the result equals the two kernels' bit for bit
// (bench_quant's checks, H200). H200: 48.1 against 50.9 us at 1000 x 14336 bf16 (1.06x), 1.10x
// at 16384 rows, 1.11-1.15x at 28672; 36-51% of copy bandwidth: per element it still pays
// silu's expf and division and the division by the scale, which the bits require
// (bench/results/NVIDIA_H200/silu_mul_fp8_quant_20261129).
#include <cstdint>
#include <type_traits>

#include "activation/activation.cuh"
#include "common/check.cuh"
#include "common/launch.cuh"
#include "pyorch/quantization.h"
#include "quantization/quant.cuh"

namespace pyorch {
namespace kernels {

// grid: [num_tokens], block: [NUM_THREADS]; VPT vectors of 16 bytes a thread (vector v of the
// row is thread v % NUM_THREADS's j = v / NUM_THREADS, the layout store_fp8_row stores). At most
// 64 registers a thread (1024 threads an SM): at 256 threads and 8 vectors a thread (167
// registers, one CTA an SM) the kernel ran at 0.67x the two kernels it replaces on an H200.
template <typename T, int VPT, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, 1024 / NUM_THREADS)
    silu_and_mul_fp8_quant_kernel(uint8_t* __restrict__ out,   // [num_tokens, d] (out_stride)
                                  float* __restrict__ scales,  // [num_tokens]
                                  const T* __restrict__ in,    // [num_tokens, 2 * d] (in_stride)
                                  const float* __restrict__ scale_ub,  // [1] or null
                                  int64_t d, int64_t out_stride, int64_t in_stride) {
  constexpr int VEC = 16 / sizeof(T);
  using V = Vec<T, VEC>;
  pdl_wait();  // in is the previous kernel's output (gate_up_proj's GEMM)
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const T* gate = in + row * in_stride;
  const T* up = gate + d;
  const int num_vecs = static_cast<int>(d / VEC);

  // All loads first (2 * VPT 16-byte loads in flight a thread), then the math in place in g.
  V g[VPT], u[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * NUM_THREADS;
    if (i < num_vecs) {
      g[j].load(gate + int64_t(i) * VEC);
      u[j].load(up + int64_t(i) * VEC);
    }
  }
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * NUM_THREADS;
    if (i < num_vecs) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        // act_and_mul_kernel's expression: the value silu_and_mul stores.
        g[j].data[e] = from_float<T>(act_fn<Activation::kSilu>(to_float(g[j].data[e])) *
                                     to_float(u[j].data[e]));
        m = fmaxf(m, fabsf(to_float(g[j].data[e])));
      }
    }
  }
  const float s = row_fp8_scale(block_reduce_max<NUM_THREADS>(m), scale_ub, scales, row);
  store_fp8_row<T, VEC, VPT, NUM_THREADS>(out + row * out_stride, g, num_vecs, s);
}

}  // namespace kernels

namespace {

// Threads a row: the fewest of 256, 512, 1024 that hold it in at most kMaxVectorsPerThread
// vectors a thread. H200, 1000 to 16384 rows of bf16 (bench_quant): 512 x 4 vectors at d = 14336
// and 1024 x 4 at 28672 ran at 1.06-1.15x the two kernels; 256 x 8 and 512 x 8 (spilling under
// the 64-register cap) at 0.45-0.85x. Rows past 1024 x 4 vectors (d > 32768 bf16 / fp16,
// 16384 fp32) run the two ops.
constexpr int kMaxVectorsPerThread = 4;

int64_t vec_elems(DType dtype) { return dtype == DType::kFloat32 ? 4 : 8; }

int threads_per_row(int64_t num_vecs) {
  for (int threads : {256, 512}) {
    if (num_vecs <= int64_t{threads} * kMaxVectorsPerThread) return threads;
  }
  return 1024;
}

}  // namespace

bool silu_and_mul_dynamic_per_token_fp8_quant_supported(DType dtype, int64_t d, const void* out,
                                                        const void* in, int64_t out_stride,
                                                        int64_t in_stride) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return false;
  }
  const int64_t vec = vec_elems(dtype);
  // d a multiple of the vector keeps the up half (at offset d) 16-byte aligned too.
  if (d < 1 || d % vec != 0 || d / vec > int64_t{1024} * kMaxVectorsPerThread) return false;
  if (reinterpret_cast<uintptr_t>(in) % 16 != 0 || in_stride % vec != 0) return false;
  return reinterpret_cast<uintptr_t>(out) % vec == 0 && out_stride % vec == 0;
}

cudaError_t silu_and_mul_dynamic_per_token_fp8_quant(void* out, float* scales, const void* in,
                                                     const float* scale_ub, DType dtype,
                                                     int64_t num_tokens, int64_t d,
                                                     int64_t out_stride, int64_t in_stride,
                                                     cudaStream_t stream) {
  if (!silu_and_mul_dynamic_per_token_fp8_quant_supported(dtype, d, out, in, out_stride,
                                                          in_stride)) {
    PYORCH_INVALID(
        "silu_and_mul_dynamic_per_token_fp8_quant: rows this kernel does not take (dtype %s, d "
        "%lld): run silu_and_mul and dynamic_per_token_scaled_fp8_quant",
        dtype_name(dtype), static_cast<long long>(d));
  }
  if (num_tokens == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff) {
    PYORCH_INVALID("silu_and_mul_dynamic_per_token_fp8_quant: %lld rows are too many",
                   static_cast<long long>(num_tokens));
  }
  const int64_t num_vecs = d / vec_elems(dtype);
  const int threads = threads_per_row(num_vecs);
  const int64_t vpt = (num_vecs + threads - 1) / threads;
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const bool pdl = pdl_enabled();
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    auto launch = [&](auto vpt_c, auto threads_c) {
      constexpr int kThreads = decltype(threads_c)::value;
      return kernels::launch_kernel(
          &kernels::silu_and_mul_fp8_quant_kernel<T, decltype(vpt_c)::value, kThreads>, grid,
          dim3(kThreads), 0, stream, pdl, static_cast<uint8_t*>(out), scales,
          static_cast<const T*>(in), scale_ub, d, out_stride, in_stride);
    };
    using Vpt4 = std::integral_constant<int, 4>;
    if (threads == 1024) return launch(Vpt4{}, std::integral_constant<int, 1024>{});
    if (threads == 512) return launch(Vpt4{}, std::integral_constant<int, 512>{});
    using Threads256 = std::integral_constant<int, 256>;
    if (vpt <= 1) return launch(std::integral_constant<int, 1>{}, Threads256{});
    if (vpt <= 2) return launch(std::integral_constant<int, 2>{}, Threads256{});
    return launch(Vpt4{}, Threads256{});
  });
}

}  // namespace pyorch
