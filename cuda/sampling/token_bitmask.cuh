// The structured-output token bitmask applied to the logits: -inf where a token is not allowed.
//
// Layout of the work: grid.x walks the masked rows (through indices when given: up to 2^31 - 1 of
// them), grid.y tiles a row's vocabulary; a thread owns one 32-bit mask word, i.e. 32 consecutive
// logits. A word with every bit set (the common case for JSON string bodies and for unconstrained
// padding) costs one 4-byte load and no store; otherwise only the disallowed logits are written.
// The kernel never reads the logits: the op is a masked store, bound by the mask's bytes (1/16 of
// the logits' bytes in fp16) plus the stores of disallowed tokens.
#pragma once

#include <cstdint>

#include "common/check.cuh"
#include "common/dtype.cuh"

namespace pyorch::kernels {

constexpr int kBitmaskThreads = 128;
constexpr int kBitsPerWord = 32;

template <typename T>
__global__ void apply_token_bitmask_kernel(T* __restrict__ logits,               // [rows, vocab]
                                           const int32_t* __restrict__ bitmask,  // [rows, words]
                                           const int32_t* __restrict__ indices,  // [grid.x] or null
                                           int64_t num_rows, int64_t vocab_size,
                                           int64_t logits_stride, int64_t bitmask_stride) {
  const int64_t row = indices == nullptr ? static_cast<int64_t>(blockIdx.x) : indices[blockIdx.x];
  if (row < 0 || row >= num_rows) return;
  const int64_t word_idx = static_cast<int64_t>(blockIdx.y) * kBitmaskThreads + threadIdx.x;
  const int64_t first = word_idx * kBitsPerWord;
  if (first >= vocab_size) return;
  const uint32_t word = static_cast<uint32_t>(bitmask[row * bitmask_stride + word_idx]);
  if (word == 0xffffffffu) return;
  T* out = logits + row * logits_stride + first;
  const int num_bits =
      vocab_size - first < kBitsPerWord ? static_cast<int>(vocab_size - first) : kBitsPerWord;
  const T neg_inf = from_float<T>(-__int_as_float(0x7f800000));
#pragma unroll 4
  for (int b = 0; b < num_bits; ++b) {
    if (((word >> b) & 1u) == 0u) out[b] = neg_inf;
  }
}

template <typename T>
cudaError_t launch_apply_token_bitmask(T* logits, const int32_t* bitmask, const int32_t* indices,
                                       int64_t num_rows, int64_t num_indices, int64_t vocab_size,
                                       int64_t logits_stride, int64_t bitmask_stride,
                                       cudaStream_t stream) {
  const int64_t grid_rows = indices == nullptr ? num_rows : num_indices;
  if (grid_rows == 0 || vocab_size == 0) return cudaSuccess;
  const int64_t num_words = (vocab_size + kBitsPerWord - 1) / kBitsPerWord;
  const dim3 grid(static_cast<unsigned>(grid_rows),
                  static_cast<unsigned>((num_words + kBitmaskThreads - 1) / kBitmaskThreads));
  apply_token_bitmask_kernel<T><<<grid, kBitmaskThreads, 0, stream>>>(
      logits, bitmask, indices, num_rows, vocab_size, logits_stride, bitmask_stride);
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
