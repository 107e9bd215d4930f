// Warp and block reductions over fp32.
#pragma once

namespace pyorch::kernels {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float warp_reduce_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

__device__ __forceinline__ float warp_reduce_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// Sum over the whole block; every thread gets the result. NUM_THREADS is a multiple of 32.
template <int NUM_THREADS>
__device__ __forceinline__ float block_reduce_sum(float x) {
  static_assert(NUM_THREADS % kWarpSize == 0 && NUM_THREADS <= 1024, "block size");
  constexpr int kNumWarps = NUM_THREADS / kWarpSize;
  __shared__ float partial[kNumWarps];
  x = warp_reduce_sum(x);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  x = lane < kNumWarps ? partial[lane] : 0.f;
  x = warp_reduce_sum(x);
  __syncthreads();  // partial[] may be reused by the caller's next reduction
  return x;
}

}  // namespace pyorch::kernels
