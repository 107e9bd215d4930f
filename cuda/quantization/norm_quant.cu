// RMSNorm + dynamic per-token fp8 quantization in one kernel (pyorch/quantization.h:
// rms_norm_dynamic_per_token_fp8_quant). Before it, an fp8 layer ran the norm (writing the normed
// row in bf16) and then the quantizer (reading it back): at 16384 tokens of Llama-3-8B that round
// trip is 2 x 134 MB per norm. Here the row stays in registers from the residual add to the fp8
// store. The arithmetic is rms_norm_kernel's / fused_add_rms_norm_kernel's (the same per-thread
// order of the sum of squares: vectors t, t + 256, ...; the same block reduction; the normed
// value rounded to T before the weight multiply) and then fp8_quant_rows_vec_kernel's, so the
// result equals the two ops' on this device bit for bit.
#include <cstdint>
#include <type_traits>

#include "common/check.cuh"
#include "common/launch.cuh"
#include "norm/rms_norm.cuh"
#include "pyorch/quantization.h"
#include "quantization/quant.cuh"

namespace pyorch {
namespace kernels {

// grid: [num_tokens], block: [kNormThreads]; VPT vectors of 16 bytes a thread.
template <typename T, int VPT, bool RESIDUAL>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_fp8_quant_kernel(uint8_t* __restrict__ out, float* __restrict__ scales,
                              const T* __restrict__ in, T* __restrict__ residual,
                              const T* __restrict__ weight, const float* __restrict__ scale_ub,
                              int64_t hidden, int64_t out_stride, int64_t in_stride,
                              int64_t residual_stride, float eps) {
  static_assert(kNormThreads == kQuantThreads, "one block size for both halves");
  constexpr int VEC = 16 / sizeof(T);
  using V = Vec<T, VEC>;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const T* x = in + row * in_stride;
  T* r = RESIDUAL ? residual + row * residual_stride : nullptr;
  const int num_vecs = static_cast<int>(hidden / VEC);

  V v[VPT];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < num_vecs) {
      v[j].load(x + int64_t(i) * VEC);
      if constexpr (RESIDUAL) {
        V rv;
        rv.load(r + int64_t(i) * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          // residual += input, rounded to T: the residual stream is stored in T.
          v[j].data[e] = from_float<T>(to_float(v[j].data[e]) + to_float(rv.data[e]));
        }
        v[j].store(r + int64_t(i) * VEC);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float f = to_float(v[j].data[e]);
        sum_sq += f * f;
      }
    }
  }
  sum_sq = block_reduce_sum<kNormThreads>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);

  float m = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < num_vecs) {
      V w;
      w.load(weight + int64_t(i) * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float normed = to_float(from_float<T>(to_float(v[j].data[e]) * inv_rms));
        v[j].data[e] = from_float<T>(normed * to_float(w.data[e]));
        m = fmaxf(m, fabsf(to_float(v[j].data[e])));
      }
    }
  }
  const float s = row_fp8_scale(block_reduce_max<kQuantThreads>(m), scale_ub, scales, row);
  store_fp8_row<T, VEC, VPT>(out + row * out_stride, v, num_vecs, s);
}

}  // namespace kernels

namespace {

constexpr int kMaxVectorsPerThread = 16;

size_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Vectors of 16 bytes each thread holds for a row of `hidden` elements of dtype.
int64_t vectors_per_thread(DType dtype, int64_t hidden) {
  const int64_t vec = 16 / static_cast<int64_t>(dtype_bytes(dtype));
  return (hidden / vec + kernels::kNormThreads - 1) / kernels::kNormThreads;
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool rms_norm_dynamic_per_token_fp8_quant_supported(DType dtype, int64_t hidden, const void* out,
                                                    const void* in, const void* residual,
                                                    const void* weight, int64_t out_stride,
                                                    int64_t in_stride, int64_t residual_stride) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return false;
  }
  const int64_t vec = 16 / static_cast<int64_t>(dtype_bytes(dtype));
  if (hidden < 1 || hidden % vec != 0 || vectors_per_thread(dtype, hidden) > kMaxVectorsPerThread) {
    return false;
  }
  if (!aligned(in, 16) || !aligned(weight, 16) || in_stride % vec != 0) return false;
  if (residual != nullptr && (!aligned(residual, 16) || residual_stride % vec != 0)) return false;
  return aligned(out, static_cast<size_t>(vec)) && out_stride % vec == 0;
}

cudaError_t rms_norm_dynamic_per_token_fp8_quant(
    void* out, float* scales, const void* in, void* residual, const void* weight,
    const float* scale_ub, DType dtype, int64_t num_tokens, int64_t hidden, int64_t out_stride,
    int64_t in_stride, int64_t residual_stride, float eps, cudaStream_t stream) {
  if (!rms_norm_dynamic_per_token_fp8_quant_supported(dtype, hidden, out, in, residual, weight,
                                                      out_stride, in_stride, residual_stride)) {
    PYORCH_INVALID(
        "rms_norm_dynamic_per_token_fp8_quant: rows this kernel does not take (dtype %s, hidden "
        "%lld): run rms_norm and dynamic_per_token_scaled_fp8_quant",
        dtype_name(dtype), (long long)hidden);
  }
  if (num_tokens == 0) return cudaSuccess;
  const int64_t vpt = vectors_per_thread(dtype, hidden);
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const bool pdl = pdl_enabled();
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    auto launch = [&](auto vpt_c, auto residual_c) {
      constexpr int kVpt = decltype(vpt_c)::value;
      constexpr bool kResidual = decltype(residual_c)::value;
      return kernels::launch_kernel(&kernels::rms_norm_fp8_quant_kernel<T, kVpt, kResidual>, grid,
                                    dim3(kernels::kNormThreads), 0, stream, pdl,
                                    static_cast<uint8_t*>(out), scales, static_cast<const T*>(in),
                                    static_cast<T*>(residual), static_cast<const T*>(weight),
                                    scale_ub, hidden, out_stride, in_stride, residual_stride, eps);
    };
    auto by_residual = [&](auto vpt_c) {
      return residual != nullptr ? launch(vpt_c, std::true_type{})
                                 : launch(vpt_c, std::false_type{});
    };
    if (vpt <= 1) return by_residual(std::integral_constant<int, 1>{});
    if (vpt <= 2) return by_residual(std::integral_constant<int, 2>{});
    if (vpt <= 4) return by_residual(std::integral_constant<int, 4>{});
    if (vpt <= 8) return by_residual(std::integral_constant<int, 8>{});
    return by_residual(std::integral_constant<int, 16>{});
  });
}

}  // namespace pyorch
