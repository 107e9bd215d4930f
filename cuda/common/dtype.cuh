// Device-side element types, conversions and the runtime-dtype -> template dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "check.cuh"
#include "pyorch/dtype.h"

namespace pyorch::kernels {

// Scalar conversions to and from fp32, the accumulation type of every kernel.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// fp8 e4m3 stored as a byte; saturating conversion like torch's to(torch.float8_e4m3fn) (which
// saturates only in the sense of clamping to +-448 here: callers clamp before converting).
__device__ __forceinline__ uint8_t float_to_fp8(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float fp8_to_float(uint8_t x) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(x), __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace pyorch::kernels

// Runs BODY with T bound to the device type of a floating dtype (fp32, fp16, bf16).
#define PYORCH_DISPATCH_FLOAT_TYPES(DTYPE, T, ...)                                  \
  [&]() -> cudaError_t {                                                            \
    switch (DTYPE) {                                                                \
      case ::pyorch::DType::kFloat32: {                                             \
        using T = float;                                                            \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      case ::pyorch::DType::kFloat16: {                                             \
        using T = __half;                                                           \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      case ::pyorch::DType::kBFloat16: {                                            \
        using T = __nv_bfloat16;                                                    \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      default: PYORCH_INVALID("unsupported dtype %s", ::pyorch::dtype_name(DTYPE)); \
    }                                                                               \
  }()

// Same, for the 16-bit types only (kernels that use packed half2/bfloat162 math or tensor cores).
#define PYORCH_DISPATCH_HALF_TYPES(DTYPE, T, ...)                                   \
  [&]() -> cudaError_t {                                                            \
    switch (DTYPE) {                                                                \
      case ::pyorch::DType::kFloat16: {                                             \
        using T = __half;                                                           \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      case ::pyorch::DType::kBFloat16: {                                            \
        using T = __nv_bfloat16;                                                    \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      default: PYORCH_INVALID("unsupported dtype %s", ::pyorch::dtype_name(DTYPE)); \
    }                                                                               \
  }()
