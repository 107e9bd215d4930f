// Helpers shared by the torch adapters (cpp/ops) and the CPU kernels (cpp/cpu).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "pyorch/dtype.h"

namespace pyorch {

inline DType to_pyorch_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3;
    case at::kByte: return DType::kFp8E4M3;  // fp8 KV caches are allocated as uint8
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    default: TORCH_CHECK(false, "pyorch: unsupported dtype ", t);
  }
}

// Parses vLLM's kv_cache_dtype strings. "fp8" is vLLM's alias for fp8_e4m3 on NVIDIA.
inline KVCacheDType parse_kv_cache_dtype(const std::string& s) {
  if (s == "auto") return KVCacheDType::kAuto;
  if (s == "fp8" || s == "fp8_e4m3") return KVCacheDType::kFp8E4M3;
  TORCH_CHECK(false, "pyorch: unsupported kv_cache_dtype '", s, "' (expected auto or fp8_e4m3)");
}

// Checks that a KV cache tensor's dtype fits kv_cache_dtype and the model dtype.
inline void check_kv_cache_dtype(const at::Tensor& cache, KVCacheDType kv_dtype,
                                 at::ScalarType model_dtype, const char* op) {
  if (kv_dtype == KVCacheDType::kAuto) {
    TORCH_CHECK(cache.scalar_type() == model_dtype, op, ": kv_cache_dtype=auto needs a ",
                model_dtype, " cache, got ", cache.scalar_type());
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kByte || cache.scalar_type() == at::kFloat8_e4m3fn, op,
                ": an fp8_e4m3 cache must be uint8 or float8_e4m3fn, got ", cache.scalar_type());
  }
}

// Reads a one-element float scale tensor (k_scale / v_scale) on the host.
inline float scale_value(const at::Tensor& scale, const char* op) {
  TORCH_CHECK(scale.numel() == 1, op, ": scale tensors must hold one element");
  return scale.item<float>();
}

// The adapters' device check: every tensor on the first one's CUDA device.
inline void check_same_cuda(std::initializer_list<const at::Tensor*> tensors, const char* op) {
  const at::Device device = (*tensors.begin())->device();
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_cuda() && t->device() == device, op,
                ": tensors must be on the same CUDA device");
  }
}

// Whether a tensor's data starts on a 16-byte boundary (the kernels' vector loads).
inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// paged_attention's optional lse output: float32 [num_heads, >= num_tokens] with contiguous rows,
// on query's device ("CPU" / "CUDA" names it in the error).
inline void check_lse_out(const at::Tensor& lse, const at::Tensor& query, const char* where) {
  TORCH_CHECK(lse.device() == query.device() && lse.scalar_type() == at::kFloat && lse.dim() == 2 &&
                  lse.size(0) == query.size(1) && lse.size(1) >= query.size(0) &&
                  lse.stride(1) == 1,
              "paged_attention: lse must be a float32 ", where,
              " tensor [num_heads, num_tokens] with contiguous rows on query's device");
}

}  // namespace pyorch

// Turns a cudaError_t from the cuda/ C API into a Python exception.
#define PYORCH_CHECK_CUDA(expr)                                                      \
  do {                                                                               \
    cudaError_t pyorch_status_ = (expr);                                             \
    TORCH_CHECK(pyorch_status_ == cudaSuccess, "pyorch CUDA error in ", #expr, ": ", \
                cudaGetErrorString(pyorch_status_));                                 \
  } while (0)
