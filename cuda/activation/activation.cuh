// Gated activation kernels: out = act(gate) * up over rows of [gate | up], fp32 math, rounded once.
//
// Layout of the work: a block is (bx column threads) x (by rows); each thread owns kActUnroll
// VEC_SIZE-wide column vectors of one row, spaced bx apart, and issues all of their loads before
// any math so that 2 * kActUnroll 16-byte loads are in flight per thread. Rows go on grid.x (up to
// 2^31 - 1 of them), column tiles on grid.y.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "pyorch/activation.h"

namespace pyorch::kernels {

constexpr int kActThreads = 256;
constexpr int kActUnroll = 2;

template <Activation ACT>
__device__ __forceinline__ float act_fn(float x);

template <>
__device__ __forceinline__ float act_fn<Activation::kSilu>(float x) {
  return x / (1.f + expf(-x));
}

template <>
__device__ __forceinline__ float act_fn<Activation::kGelu>(float x) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  return 0.5f * x * (1.f + erff(x * kInvSqrt2));
}

// 0.5 * (1 + tanh(z)) == sigmoid(2z): the sigmoid form keeps relative accuracy where tanh(z)
// is close to -1 (large negative x), and saturates to 0 / x correctly at both ends.
template <>
__device__ __forceinline__ float act_fn<Activation::kGeluTanh>(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  const float z = kSqrt2OverPi * (x + 0.044715f * x * x * x);
  return x / (1.f + expf(-2.f * z));
}

// Stores a Vec with one st.global of its full width. NOTE(elementwise): nvcc splits the aggregate
// copy in Vec::store into 4-byte stores when the Vec lives in a small array, as it does here
// (seen in the PTX); the __stwb intrinsics take a word and cannot be split.
template <typename T, int VEC_SIZE>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T, VEC_SIZE>& v) {
  constexpr int kBytes = sizeof(T) * VEC_SIZE;
  using Word = std::conditional_t<
      kBytes == 16, int4,
      std::conditional_t<kBytes == 8, int2, std::conditional_t<kBytes == 4, int, short>>>;
  static_assert(sizeof(Word) == kBytes, "a Vec of 2, 4, 8 or 16 bytes");
  Word w;
  memcpy(&w, &v, kBytes);
  __stwb(reinterpret_cast<Word*>(ptr), w);
}

template <typename T, Activation ACT, int VEC_SIZE>
__global__ void __launch_bounds__(kActThreads)
    act_and_mul_kernel(T* __restrict__ out,       // [num_tokens, d] (row stride out_stride)
                       const T* __restrict__ in,  // [num_tokens, 2 * d] (row stride in_stride)
                       int64_t num_tokens, int64_t d, int64_t out_stride, int64_t in_stride) {
  using V = Vec<T, VEC_SIZE>;
  pdl_wait();  // launched with PDL (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= num_tokens) return;
  const int64_t num_vecs = d / VEC_SIZE;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x * kActUnroll + threadIdx.x;
  const T* gate = in + row * in_stride;
  const T* up = gate + d;
  T* y = out + row * out_stride;

  V g[kActUnroll], u[kActUnroll];
#pragma unroll
  for (int k = 0; k < kActUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * blockDim.x;
    if (i < num_vecs) {
      g[k].load(gate + i * VEC_SIZE);
      u[k].load(up + i * VEC_SIZE);
    }
  }
#pragma unroll
  for (int k = 0; k < kActUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * blockDim.x;
    if (i < num_vecs) {
#pragma unroll
      for (int j = 0; j < VEC_SIZE; ++j) {
        g[k].data[j] = from_float<T>(act_fn<ACT>(to_float(g[k].data[j])) * to_float(u[k].data[j]));
      }
      store_vec(y + i * VEC_SIZE, g[k]);
    }
  }
}

template <typename T, Activation ACT, int VEC_SIZE>
cudaError_t launch_act_and_mul_vec(T* out, const T* in, int64_t num_tokens, int64_t d,
                                   int64_t out_stride, int64_t in_stride, cudaStream_t stream) {
  const int64_t num_vecs = d / VEC_SIZE;
  // Column tiles of at most kActThreads * kActUnroll vectors, split evenly (rounded up to whole
  // warps) so that no tile runs mostly idle; short rows leave room for several rows per block.
  const int64_t max_tile = int64_t{kActThreads} * kActUnroll;
  const int64_t num_tiles = (num_vecs + max_tile - 1) / max_tile;
  const int64_t per_tile = (num_vecs + num_tiles - 1) / num_tiles;
  const int bx = static_cast<int>((((per_tile + kActUnroll - 1) / kActUnroll) + 31) / 32 * 32);
  const int by = static_cast<int>(std::min<int64_t>(kActThreads / bx, num_tokens));
  const int64_t row_blocks = (num_tokens + by - 1) / by;
  const int64_t col_blocks = (num_vecs + int64_t{bx} * kActUnroll - 1) / (int64_t{bx} * kActUnroll);
  if (row_blocks > 0x7fffffff || col_blocks > 65535) {
    PYORCH_INVALID("act_and_mul: shape [%lld, %lld] is too large",
                   static_cast<long long>(num_tokens), static_cast<long long>(d));
  }
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_blocks));
  return launch_kernel(&act_and_mul_kernel<T, ACT, VEC_SIZE>, grid, dim3(bx, by), 0, stream,
                       pdl_enabled(), out, in, num_tokens, d, out_stride, in_stride);
}

template <typename T, Activation ACT>
cudaError_t launch_act_and_mul(T* out, const T* in, int64_t num_tokens, int64_t d,
                               int64_t out_stride, int64_t in_stride, cudaStream_t stream) {
  if (num_tokens == 0 || d == 0) return cudaSuccess;
  // d itself must be a multiple of the vector so that the up half (at offset d) stays aligned.
  const int vec = max_vec_size<T>(d, {out, in}, {out_stride, in_stride});
  constexpr int kMaxVec = 16 / sizeof(T);
  switch (vec) {
#define PYORCH_CASE(V)                                                                        \
  case V:                                                                                     \
    if constexpr (V <= kMaxVec) {                                                             \
      return launch_act_and_mul_vec<T, ACT, V>(out, in, num_tokens, d, out_stride, in_stride, \
                                               stream);                                       \
    }                                                                                         \
    break;
    PYORCH_CASE(1)
    PYORCH_CASE(2)
    PYORCH_CASE(4)
    PYORCH_CASE(8)
#undef PYORCH_CASE
    default: break;
  }
  PYORCH_INVALID("act_and_mul: bad vector size %d", vec);
}

}  // namespace pyorch::kernels
