// The load-time and large-M helpers of W4A16: repacking GPTQ / AWQ codes into the w4 tiles
// (pyorch/w4a16.h), dequantizing tiles back to a 16-bit weight (the large-M path feeds it to
// cuBLAS) and act-order's column permutation of the activations. One thread per output word or
// element: these run once per load, or beside a GEMM that re-reads the result many times.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "pyorch/w4a16.h"

namespace pyorch::kernels {

constexpr int kW4HelperThreads = 256;

// out: w4 tiles [n / 16, k * 2]; b_q: GPTQ [k / 8, n] (AWQ = false) or AWQ [k, n / 8].
template <bool AWQ>
__global__ void w4a16_repack_kernel(uint32_t* __restrict__ out, const uint32_t* __restrict__ b_q,
                                    const int32_t* __restrict__ perm, int64_t size_k,
                                    int64_t size_n) {
  const int64_t word = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (word >= size_k * size_n / 8) return;
  uint32_t packed = 0;
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    int64_t n, k;
    w4a16_code_coord(word, p, size_k, size_n, &n, &k);
    uint32_t code;
    if constexpr (AWQ) {
      code = b_q[k * (size_n / 8) + n / 8] >> (4 * awq_nibble_of_column(static_cast<int>(n % 8)));
    } else {
      const int64_t src_k = perm != nullptr ? perm[k] : k;
      code = b_q[(src_k / 8) * size_n + n] >> (4 * (src_k % 8));
    }
    packed |= (code & 0xF) << (4 * p);
  }
  out[word] = packed;
}

// out: [n_count, k] (row-major) = W^T of the tiles' columns n_begin .. n_begin + n_count.
template <typename T, bool HAS_ZEROS>
__global__ void w4a16_dequantize_kernel(T* __restrict__ out, const uint32_t* __restrict__ b_q,
                                        const T* __restrict__ scales,
                                        const uint32_t* __restrict__ zeros, int64_t size_n,
                                        int64_t size_k, int64_t group_size, int64_t n_begin,
                                        int64_t n_count) {
  const int64_t local = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (local >= n_count * size_k / 8) return;
  const int64_t word = n_begin / kW4A16TileN * (size_k * 2) + local;  // tiles are n-major
  const uint32_t packed = b_q[word];
#pragma unroll
  for (int p = 0; p < 4; ++p) {  // codes p and p + 4 are neighbours k, k + 1 of one column
    int64_t n, k;
    w4a16_code_coord(word, p, size_k, size_n, &n, &k);
    const int64_t group = k / group_size;
    const int z =
        HAS_ZEROS ? static_cast<int>((zeros[group * (size_n / 8) + n / 8] >> (4 * (n % 8))) & 0xF)
                  : 8;
    const float s = to_float(scales[group * size_n + n]);
    const int q0 = static_cast<int>((packed >> (4 * p)) & 0xF);
    const int q1 = static_cast<int>((packed >> (4 * (p + 4))) & 0xF);
    T* dst = out + (n - n_begin) * size_k + k;
    dst[0] = from_float<T>(static_cast<float>(q0 - z) * s);  // exact product, rounded once
    dst[1] = from_float<T>(static_cast<float>(q1 - z) * s);
  }
}

// a_out [m, k] = a[:, perm].
template <typename T>
__global__ void w4a16_permute_cols_kernel(T* __restrict__ a_out, const T* __restrict__ a,
                                          const int32_t* __restrict__ perm, int64_t size_m,
                                          int64_t size_k, int64_t a_stride) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= size_m * size_k) return;
  const int64_t row = idx / size_k, col = idx % size_k;
  a_out[idx] = a[row * a_stride + perm[col]];
}

inline unsigned w4_helper_blocks(int64_t items) {
  return static_cast<unsigned>((items + kW4HelperThreads - 1) / kW4HelperThreads);
}

}  // namespace pyorch::kernels
