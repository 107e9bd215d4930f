// The C API of the quantization kernels (cuda/include/pyorch/quantization.h): dtype dispatch and
// launches on the caller's stream; no synchronization.
#include <cstdint>
#include <type_traits>

#include "quantization/quant.cuh"

namespace pyorch {
namespace {

inline dim3 rows_grid(int64_t num_tokens) { return dim3(static_cast<unsigned>(num_tokens)); }

// Dynamic per-tensor scale, pass 2 (one block after fp8_absmax_kernel): the floor on the scale,
// written back once. Defined here, not in quant.cuh: a non-template kernel in a header included by
// two translation units (quant.cu, norm_quant.cu) is defined twice at link time.
__global__ void fp8_scale_floor_kernel(float* __restrict__ scale) {
  if (threadIdx.x == 0) *scale = fmaxf(*scale, kQuantFp8MinScale);
}

// fp8 rows, static (scales null) or per token: the register-resident vector kernel where the
// row's size and alignment allow (fp8_quant_rows_vec_kernel), else the element-wise one.
template <typename T, bool PER_TOKEN>
cudaError_t launch_fp8_quant_rows(uint8_t* out, const T* in, const float* scale, float* scales,
                                  const float* scale_ub, int64_t num_tokens, int64_t hidden,
                                  int64_t out_stride, int64_t in_stride, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec_ok = kernels::max_vec_size<T>(hidden, {in}, {in_stride}) == kVec &&
                      reinterpret_cast<uintptr_t>(out) % kVec == 0 && out_stride % kVec == 0;
  const int64_t per_thread = (hidden / kVec + kernels::kQuantThreads - 1) / kernels::kQuantThreads;
  auto vec = [&](auto vpt) {
    kernels::fp8_quant_rows_vec_kernel<T, decltype(vpt)::value, PER_TOKEN>
        <<<rows_grid(num_tokens), kernels::kQuantThreads, 0, stream>>>(
            out, in, scale, scales, scale_ub, hidden, out_stride, in_stride);
    return cudaGetLastError();
  };
  if (vec_ok && per_thread <= 1) return vec(std::integral_constant<int, 1>{});
  if (vec_ok && per_thread <= 2) return vec(std::integral_constant<int, 2>{});
  if (vec_ok && per_thread <= 4) return vec(std::integral_constant<int, 4>{});
  if (vec_ok && per_thread <= 8) return vec(std::integral_constant<int, 8>{});
  if (vec_ok && per_thread <= 16) return vec(std::integral_constant<int, 16>{});
  kernels::fp8_quant_rows_kernel<T, PER_TOKEN>
      <<<rows_grid(num_tokens), kernels::kQuantThreads, 0, stream>>>(
          out, in, scale, scales, scale_ub, hidden, out_stride, in_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t static_scaled_fp8_quant(void* out, const void* in, const float* scale, DType dtype,
                                    int64_t num_tokens, int64_t hidden, int64_t out_stride,
                                    int64_t in_stride, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    return launch_fp8_quant_rows<T, false>(static_cast<uint8_t*>(out), static_cast<const T*>(in),
                                           scale, nullptr, nullptr, num_tokens, hidden, out_stride,
                                           in_stride, stream);
  });
}

cudaError_t dynamic_scaled_fp8_quant(void* out, const void* in, float* scale, DType dtype,
                                     int64_t num_tokens, int64_t hidden, int64_t out_stride,
                                     int64_t in_stride, cudaStream_t stream) {
  PYORCH_RETURN_IF_ERROR(cudaMemsetAsync(scale, 0, sizeof(float), stream));
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    if (num_tokens > 0) {
      kernels::fp8_absmax_kernel<T><<<rows_grid(num_tokens), kernels::kQuantThreads, 0, stream>>>(
          scale, static_cast<const T*>(in), hidden, in_stride);
      PYORCH_RETURN_IF_ERROR(cudaGetLastError());
    }
    fp8_scale_floor_kernel<<<1, 32, 0, stream>>>(scale);
    PYORCH_RETURN_IF_ERROR(cudaGetLastError());
    return static_scaled_fp8_quant(out, in, scale, dtype, num_tokens, hidden, out_stride, in_stride,
                                   stream);
  });
}

cudaError_t dynamic_per_token_scaled_fp8_quant(void* out, const void* in, float* scales,
                                               const float* scale_ub, DType dtype,
                                               int64_t num_tokens, int64_t hidden,
                                               int64_t out_stride, int64_t in_stride,
                                               cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    return launch_fp8_quant_rows<T, true>(static_cast<uint8_t*>(out), static_cast<const T*>(in),
                                          nullptr, scales, scale_ub, num_tokens, hidden, out_stride,
                                          in_stride, stream);
  });
}

cudaError_t static_scaled_int8_quant(int8_t* out, const void* in, const float* scale,
                                     const int32_t* azp, DType dtype, int64_t num_tokens,
                                     int64_t hidden, int64_t out_stride, int64_t in_stride,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    kernels::int8_static_kernel<T><<<rows_grid(num_tokens), kernels::kQuantThreads, 0, stream>>>(
        out, static_cast<const T*>(in), scale, azp, hidden, out_stride, in_stride);
    return cudaGetLastError();
  });
}

cudaError_t dynamic_scaled_int8_quant(int8_t* out, const void* in, float* scales, int32_t* azp,
                                      DType dtype, int64_t num_tokens, int64_t hidden,
                                      int64_t out_stride, int64_t in_stride, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    kernels::int8_dynamic_kernel<T><<<rows_grid(num_tokens), kernels::kQuantThreads, 0, stream>>>(
        out, static_cast<const T*>(in), scales, azp, hidden, out_stride, in_stride);
    return cudaGetLastError();
  });
}

cudaError_t per_token_group_fp8_quant(void* out, const void* in, float* scales, DType dtype,
                                      int64_t num_tokens, int64_t hidden, int64_t group_size,
                                      int64_t out_stride, int64_t in_stride, int64_t s_token_stride,
                                      int64_t s_group_stride, float eps, float fp8_min,
                                      float fp8_max, bool scale_ue8m0, cudaStream_t stream) {
  if (group_size <= 0 || hidden % group_size != 0) {
    PYORCH_INVALID("per_token_group_fp8_quant: hidden %lld is not a multiple of group_size %lld",
                   static_cast<long long>(hidden), static_cast<long long>(group_size));
  }
  const int64_t num_groups = hidden / group_size;
  const int64_t num_warps = num_tokens * num_groups;
  if (num_warps == 0) return cudaSuccess;
  constexpr int kWarpsPerBlock = kernels::kQuantThreads / kernels::kWarpSize;
  const dim3 grid(static_cast<unsigned>((num_warps + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    kernels::group_fp8_kernel<T><<<grid, kernels::kQuantThreads, 0, stream>>>(
        static_cast<uint8_t*>(out), static_cast<const T*>(in), scales, num_tokens, num_groups,
        group_size, out_stride, in_stride, s_token_stride, s_group_stride, eps, fp8_min, fp8_max,
        scale_ue8m0);
    return cudaGetLastError();
  });
}

}  // namespace pyorch
