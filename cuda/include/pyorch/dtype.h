// Torch-free element types shared by cuda/, cpp/ and bench/.
#pragma once

#include <cstdint>

namespace pyorch {

// The element types the kernels understand. cpp/ maps at::ScalarType onto these.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFp8E4M3 = 3,  // stored as uint8 bytes in KV caches
  kInt32 = 4,
  kInt64 = 5,
  kInt8 = 6,  // W8A8 int8 GEMM operands (pyorch/scaled_mm.h)
};

// How the KV cache stores its elements: in the model dtype, or as fp8 e4m3 with a per-tensor scale
// (stored = value / scale).
enum class KVCacheDType : int32_t {
  kAuto = 0,
  kFp8E4M3 = 1,
};

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFp8E4M3: return "fp8_e4m3";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt8: return "int8";
  }
  return "unknown";
}

}  // namespace pyorch
