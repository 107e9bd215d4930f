// The activation side of the GGUF products: x rounded to q8_1 (32 int8 values and an fp32 scale d
// per block, plus d * sum(q) of each 16-value half, which the weight's bias terms multiply).
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"

namespace pyorch::kernels::gguf {

// The per-block side data of a q8_1 activation: d, d * sum(q[0:16]), d * sum(q[16:32]).
struct alignas(16) Q81Scale {
  float d;
  float s[2];
  float pad;
};

// One warp per 32-value block, one value per lane.
//   xq:  [num_tokens, input_size] int8
//   xds: [num_tokens, input_size / 32]
//   x:   [num_tokens, input_size] (row stride x_stride)
template <typename T>
__global__ void quantize_q8_1_kernel(int8_t* __restrict__ xq, Q81Scale* __restrict__ xds,
                                     const T* __restrict__ x, int64_t num_tokens,
                                     int64_t input_size, int64_t x_stride) {
  const int64_t num_blocks_per_row = input_size / 32;
  const int64_t block_idx = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  pdl_wait();               // x is the previous kernel's output
  pdl_launch_dependents();  // the product may start streaming its weights now
  if (block_idx >= num_tokens * num_blocks_per_row) return;  // whole warps leave together
  const int64_t token = block_idx / num_blocks_per_row;
  const int64_t col = (block_idx % num_blocks_per_row) * 32 + lane;
  const float v = to_float(x[token * x_stride + col]);
  const float amax = warp_reduce_max(fabsf(v));
  const float d = amax / 127.f;
  // d == 0 only for an all-zero block (or one of subnormal fp32s: those become 0, as in ggml).
  // x * (1 / d), not x / d: the CPU kernels and tests/reference/gguf.py round the same product.
  const float inv_d = d == 0.f ? 0.f : 1.f / d;
  const int q = __float2int_rn(v * inv_d);
  xq[token * input_size + col] = static_cast<int8_t>(q);
  float sum = static_cast<float>(q);  // exact: |sum| <= 16 * 127
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float other_half = __shfl_xor_sync(0xffffffffu, sum, 16);
  if (lane == 0) {
    Q81Scale ds;
    ds.d = d;
    ds.s[0] = d * sum;
    ds.s[1] = d * other_half;
    ds.pad = 0.f;
    xds[block_idx] = ds;
  }
}

// One q8_1 block (32 values of x) by one thread, into shared memory: the arithmetic of
// quantize_q8_1_kernel above (the same max, scale, rounding and exact integer sums), so a product
// that quantizes its own x (mul_mat_vec_kernel's FUSE_X) gives the bits of one that reads the
// kernel's output.
//   x: 32 values, 16-byte aligned;  q: [32] int8, 16-byte aligned
template <typename T>
__device__ __forceinline__ void quantize_q8_1_block(const T* __restrict__ x, int8_t* q,
                                                    Q81Scale* ds) {
  constexpr int kPerLoad = 16 / sizeof(T);
  float v[32];
#pragma unroll
  for (int i = 0; i < 32; i += kPerLoad) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + i);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPerLoad; ++j) v[i + j] = to_float(e[j]);
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  const float d = amax / 127.f;
  const float inv_d = d == 0.f ? 0.f : 1.f / d;
  uint32_t packed[8];
  int sum[2] = {0, 0};
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int qi = __float2int_rn(v[4 * w + j] * inv_d);
      sum[w / 4] += qi;
      word |= (uint32_t(qi) & 0xffu) << (8 * j);
    }
    packed[w] = word;
  }
  reinterpret_cast<uint4*>(q)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  reinterpret_cast<uint4*>(q)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  Q81Scale s;
  s.d = d;
  s.s[0] = d * static_cast<float>(sum[0]);
  s.s[1] = d * static_cast<float>(sum[1]);
  s.pad = 0.f;
  *ds = s;
}

template <typename T>
cudaError_t launch_quantize_q8_1(int8_t* xq, Q81Scale* xds, const T* x, int64_t num_tokens,
                                 int64_t input_size, int64_t x_stride, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t num_warps = num_tokens * (input_size / 32);
  if (num_warps == 0) return cudaSuccess;
  const int64_t grid = (num_warps * kWarpSize + kThreads - 1) / kThreads;
  return launch_kernel(quantize_q8_1_kernel<T>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                       0, stream, pdl_enabled(), xq, xds, x, num_tokens, input_size, x_stride);
}

}  // namespace pyorch::kernels::gguf
