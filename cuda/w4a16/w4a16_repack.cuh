// The load-time and large-M helpers of W4A16: repacking GPTQ / AWQ codes into the w4 tiles
// (pyorch/w4a16.h), dequantizing tiles back to a 16-bit weight (the large-M path feeds it to
// cuBLAS) and act-order's column permutation of the activations. One thread per output word or
// element: these run once per load, or beside a GEMM that re-reads the result many times.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "pyorch/w4a16.h"
#include "w4a16/w4a16_gemm.cuh"  // the fragment dequantization

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
    w4a16_code_coord(word, p, size_k, &n, &k);
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

// out: [n_count, k] (row-major) = W^T of the tiles' columns n_begin .. n_begin + n_count. One
// thread per lane-slot of a (n-tile, k-block): its 16 bytes of codes are 16 consecutive k of
// columns n_lo = 16 nt + g and n_lo + 8 (the layout in pyorch/w4a16.h), dequantized as the GEMM
// kernels do (w4_dequant_frags: (q - z) * s rounded once) and written as two 32-byte runs per
// column; a warp writes 16 columns x 128 contiguous bytes. p: the weight's fields of the GEMM's
// arguments (b_q, scales, zeros, n, k, group_size, group_shift).
template <typename T, bool HAS_ZEROS>
__global__ void w4a16_dequantize_kernel(T* __restrict__ out, const W4A16GemmArgs p, int64_t n_begin,
                                        int64_t n_count) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int kblocks = p.k / static_cast<int>(kW4A16BlockK);
  if (slot >= n_count / kW4A16TileN * kblocks * 32) return;
  const int lane = static_cast<int>(slot % 32);
  const int kb = static_cast<int>(slot / 32 % kblocks);
  const int64_t nt = n_begin / kW4A16TileN + slot / 32 / kblocks;
  W4Stage stage;
  stage.codes = p.b_q[(nt * kblocks + kb) * 32 + lane];
  w4_load_group<T, HAS_ZEROS>(p, nt, kb, lane, &stage);
  uint32_t frag[4][4];
  w4_dequant_frags<T, HAS_ZEROS>(stage, frag);
  // Register r of k-tile kt: column g + 8 (r % 2), k = 16 t + 4 kt + 2 (r / 2) and the next one.
  const int g = lane / 4, t = lane % 4;
  const int64_t k0 = static_cast<int64_t>(kb) * kW4A16BlockK + 16 * t;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t col = nt * kW4A16TileN + g + 8 * half - n_begin;
    uint4* dst = reinterpret_cast<uint4*>(out + col * p.k + k0);
    dst[0] = make_uint4(frag[0][half], frag[0][half + 2], frag[1][half], frag[1][half + 2]);
    dst[1] = make_uint4(frag[2][half], frag[2][half + 2], frag[3][half], frag[3][half + 2]);
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
