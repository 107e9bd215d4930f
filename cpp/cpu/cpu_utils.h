// Small helpers for the CPU kernels: fp32 staging of rows, dtype dispatch, shape checks.
#pragma once

#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pyorch::cpu {

// Copies n elements of T into fp32 (a loop the compiler vectorizes).
template <typename T>
inline void to_float(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Rounds through T and back, to mimic a reference that materializes an intermediate in T.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Row stride of x viewed as [rows, last_dim]; the leading dims must collapse into one.
inline int64_t row_stride(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) <= 1 || x.stride(-1) == 1), op,
              ": the last dimension must be contiguous");
  if (x.dim() == 1) return x.size(0);
  for (int64_t d = 0; d + 2 < x.dim(); ++d) {
    TORCH_CHECK(x.size(d + 1) == 1 || x.stride(d) == x.stride(d + 1) * x.size(d + 1), op,
                ": leading dimensions must be collapsible into rows");
  }
  return x.stride(-2);
}

}  // namespace pyorch::cpu

// fp32, fp16 and bf16: the floating types every CPU kernel takes.
#define PYORCH_CPU_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)
