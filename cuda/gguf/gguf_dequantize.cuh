// ggml_dequantize: every sub-block of 32 weights decoded by one thread and written as 32 values.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "gguf/gguf_blocks.cuh"

namespace pyorch::kernels::gguf {

// out:    [rows, cols] (row stride out_stride)
// weight: [rows, cols / kBlockSize blocks] (row stride weight_row_stride_bytes)
// VEC: out and out_stride allow 16-byte stores of the 32 values.
template <int TYPE, typename T, bool VEC>
__global__ void dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ weight,
                                  int64_t rows, int64_t cols, int64_t weight_row_stride_bytes,
                                  int64_t out_stride) {
  using Traits = BlockTraits<TYPE>;
  constexpr int kSubs = Traits::kBlockSize / kSubSize;
  const int64_t subs_per_row = cols / kSubSize;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * subs_per_row) return;
  const int64_t row = idx / subs_per_row;
  const int64_t sub_idx = idx % subs_per_row;
  const uint8_t* block =
      weight + row * weight_row_stride_bytes + (sub_idx / kSubs) * Traits::kBlockBytes;
  Sub32 s;
  Traits::unpack(block, static_cast<int>(sub_idx % kSubs), s);
  T* dst = out + row * out_stride + sub_idx * kSubSize;
  if constexpr (VEC) {
    constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < kSubSize / kPerVec; ++v) {
      union {
        uint4 u;
        T t[kPerVec];
      } pack;
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) {
        pack.t[i] = from_float<T>(sub_value(s, v * kPerVec + i, kQSigned<TYPE>));
      }
      reinterpret_cast<uint4*>(dst)[v] = pack.u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kSubSize; ++i) dst[i] = from_float<T>(sub_value(s, i, kQSigned<TYPE>));
  }
}

// The unquantized GGUF types (F32, F16, BF16), converted to T.
//   src: [rows, cols] (row stride src_row_stride_bytes), of SrcT
template <typename SrcT, typename T>
__global__ void convert_kernel(T* __restrict__ out, const uint8_t* __restrict__ src, int64_t rows,
                               int64_t cols, int64_t src_row_stride_bytes, int64_t out_stride) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * cols) return;
  const int64_t row = idx / cols, col = idx % cols;
  const SrcT v = reinterpret_cast<const SrcT*>(src + row * src_row_stride_bytes)[col];
  out[row * out_stride + col] = from_float<T>(to_float(v));
}

}  // namespace pyorch::kernels::gguf
