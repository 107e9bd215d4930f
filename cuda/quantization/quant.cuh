// Activation quantization kernels (fp8 e4m3 and int8): one thread block per row for the
// per-tensor and per-token forms, one warp per group for the 1 x group_size form. The math is
// the CPU kernels' (cpp/cpu/quantization.cpp): IEEE fp32 division by the scale, clamp, round to
// nearest even.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "pyorch/quantization.h"

namespace pyorch::kernels {

constexpr int kQuantThreads = 256;

__device__ __forceinline__ uint8_t quant_fp8(float x, float scale, float lo, float hi) {
  return float_to_fp8(fmaxf(lo, fminf(x / scale, hi)));
}

__device__ __forceinline__ int8_t sat_int8(int32_t x) {
  return static_cast<int8_t>(min(max(x, -128), 127));
}

// Round to nearest even, then saturate to int8 (vLLM's float_to_int8_rn).
__device__ __forceinline__ int8_t quant_int8(float x) {
  return static_cast<int8_t>(fminf(fmaxf(rintf(x), -128.f), 127.f));
}

template <int NUM_THREADS>
__device__ __forceinline__ float block_reduce_max(float x) {
  static_assert(NUM_THREADS % kWarpSize == 0 && NUM_THREADS <= 1024, "block size");
  constexpr int kNumWarps = NUM_THREADS / kWarpSize;
  __shared__ float partial[kNumWarps];
  x = warp_reduce_max(x);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  x = lane < kNumWarps ? partial[lane] : -INFINITY;
  x = warp_reduce_max(x);
  __syncthreads();
  return x;
}

__device__ __forceinline__ float warp_reduce_min(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// |x| max over one row, on every thread of the block.
template <typename T>
__device__ __forceinline__ float row_absmax(const T* __restrict__ row, int64_t hidden) {
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads)
    m = fmaxf(m, fabsf(to_float(row[i])));
  return block_reduce_max<kQuantThreads>(m);
}

// A row's dynamic fp8 scale from its |x| max (on every thread), capped by *scale_ub when given
// and floored; thread 0 writes it to scales[t].
__device__ __forceinline__ float row_fp8_scale(float absmax, const float* __restrict__ scale_ub,
                                               float* __restrict__ scales, int64_t t) {
  if (scale_ub != nullptr) absmax = fminf(absmax, *scale_ub);
  const float s = fmaxf(absmax / kQuantFp8Max, kQuantFp8MinScale);
  if (threadIdx.x == 0) scales[t] = s;
  return s;
}

// Static per-tensor scale (scale[0]) or per-token dynamic scales (scales != null: computed
// here, capped by scale_ub when given). grid: [num_tokens], block: [kQuantThreads].
template <typename T, bool PER_TOKEN>
__global__ void fp8_quant_rows_kernel(uint8_t* __restrict__ out,        // [num_tokens, hidden]
                                      const T* __restrict__ in,         // [num_tokens, hidden]
                                      const float* __restrict__ scale,  // [1] (static)
                                      float* __restrict__ scales,       // [num_tokens] (per token)
                                      const float* __restrict__ scale_ub,  // [1] or null
                                      int64_t hidden, int64_t out_stride, int64_t in_stride) {
  const int64_t t = blockIdx.x;
  const T* row = in + t * in_stride;
  const float s =
      PER_TOKEN ? row_fp8_scale(row_absmax(row, hidden), scale_ub, scales, t) : fmaxf(*scale, 0.f);
  uint8_t* o = out + t * out_stride;
  for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads) {
    o[i] = quant_fp8(to_float(row[i]), s, -kQuantFp8Max, kQuantFp8Max);
  }
}

// Quantizes a row held in registers (vector j of thread i is row vector i + j * NUM_THREADS,
// num_vecs of them) with scale s and stores it as e4m3 bytes, VEC per store.
template <typename T, int VEC, int VPT, int NUM_THREADS = kQuantThreads>
__device__ __forceinline__ void store_fp8_row(uint8_t* __restrict__ o, const Vec<T, VEC> (&x)[VPT],
                                              int num_vecs, float s) {
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int v = threadIdx.x + j * NUM_THREADS;
    if (v < num_vecs) {
      Vec<uint8_t, VEC> q;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        q.data[e] = quant_fp8(to_float(x[j].data[e]), s, -kQuantFp8Max, kQuantFp8Max);
      }
      q.store(o + int64_t(v) * VEC);
    }
  }
}

// The same rows with the row held in registers: VPT 16-byte vectors of VEC elements per thread,
// read from global memory once (fp8_quant_rows_kernel reads a per-token row twice and moves one
// element per load and one byte per store: 46% of copy bandwidth on an H200 at 16384 x 14336).
// For rows of hidden % VEC == 0 elements, 16-byte aligned input rows and VEC-byte aligned output
// rows, hidden <= kQuantThreads * VPT * VEC; the launcher (quant.cu) checks and otherwise runs
// fp8_quant_rows_kernel. Bit for bit the same results: the same max (order-free), the same
// division and clamp. grid: [num_tokens], block: [kQuantThreads].
template <typename T, int VPT, bool PER_TOKEN>
__global__ void fp8_quant_rows_vec_kernel(uint8_t* __restrict__ out, const T* __restrict__ in,
                                          const float* __restrict__ scale,
                                          float* __restrict__ scales,
                                          const float* __restrict__ scale_ub, int64_t hidden,
                                          int64_t out_stride, int64_t in_stride) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t t = blockIdx.x;
  const T* row = in + t * in_stride;
  const int num_vecs = static_cast<int>(hidden / VEC);
  Vec<T, VEC> x[VPT];
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int v = threadIdx.x + j * kQuantThreads;
    if (v < num_vecs) {
      x[j].load(row + int64_t(v) * VEC);
      if constexpr (PER_TOKEN) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(to_float(x[j].data[e])));
      }
    }
  }
  const float s = PER_TOKEN ? row_fp8_scale(block_reduce_max<kQuantThreads>(m), scale_ub, scales, t)
                            : fmaxf(*scale, 0.f);
  store_fp8_row<T, VEC, VPT>(out + t * out_stride, x, num_vecs, s);
}

// atomicMax on a non-negative float through its int bits (order-preserving for x >= 0).
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float x) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(x));
}

// Dynamic per-tensor scale, pass 1: *scale (zeroed first) = max over rows of absmax / 448.
template <typename T>
__global__ void fp8_absmax_kernel(float* __restrict__ scale, const T* __restrict__ in,
                                  int64_t hidden, int64_t in_stride) {
  const float absmax = row_absmax(in + blockIdx.x * in_stride, hidden);
  if (threadIdx.x == 0) atomic_max_nonneg(scale, absmax / kQuantFp8Max);
}

// int8, static: round(x / scale) (+ azp), saturated.
template <typename T>
__global__ void int8_static_kernel(int8_t* __restrict__ out, const T* __restrict__ in,
                                   const float* __restrict__ scale,
                                   const int32_t* __restrict__ azp,  // [1] or null
                                   int64_t hidden, int64_t out_stride, int64_t in_stride) {
  const T* row = in + blockIdx.x * in_stride;
  int8_t* o = out + blockIdx.x * out_stride;
  const float s = *scale;
  for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads) {
    const float x = to_float(row[i]) / s;
    if (azp == nullptr) {
      o[i] = quant_int8(x);
    } else {
      const float r = fminf(fmaxf(rintf(x), -1e9f), 1e9f);
      o[i] = sat_int8(static_cast<int32_t>(r) + *azp);
    }
  }
}

// int8, dynamic per token, symmetric (azp null) or asymmetric.
template <typename T>
__global__ void int8_dynamic_kernel(int8_t* __restrict__ out, const T* __restrict__ in,
                                    float* __restrict__ scales, int32_t* __restrict__ azp,
                                    int64_t hidden, int64_t out_stride, int64_t in_stride) {
  const int64_t t = blockIdx.x;
  const T* row = in + t * in_stride;
  int8_t* o = out + t * out_stride;
  if (azp == nullptr) {
    const float absmax = row_absmax(row, hidden);
    if (threadIdx.x == 0) scales[t] = absmax / 127.f;
    const float inv = absmax == 0.f ? 0.f : 127.f / absmax;
    for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads) {
      o[i] = quant_int8(to_float(row[i]) * inv);
    }
    return;
  }
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads) {
    const float x = to_float(row[i]);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
  hi = block_reduce_max<kQuantThreads>(hi);
  lo = -block_reduce_max<kQuantThreads>(-lo);
  if (hidden == 0 || lo == hi) lo = fminf(lo, 0.f), hi = fmaxf(hi, 0.f);
  const float scale = (hi - lo) / 255.f;
  const int32_t z = scale == 0.f ? 0 : static_cast<int32_t>(rintf(-128.f - lo / scale));
  if (threadIdx.x == 0) {
    scales[t] = scale;
    azp[t] = z;
  }
  for (int64_t i = threadIdx.x; i < hidden; i += kQuantThreads) {
    o[i] = scale == 0.f ? int8_t{0}
                        : sat_int8(static_cast<int32_t>(rintf(to_float(row[i]) / scale)) + z);
  }
}

// One warp per (token, group). grid: ceil(num_tokens * num_groups / warps per block).
template <typename T>
__global__ void group_fp8_kernel(uint8_t* __restrict__ out, const T* __restrict__ in,
                                 float* __restrict__ scales, int64_t num_tokens, int64_t num_groups,
                                 int64_t group_size, int64_t out_stride, int64_t in_stride,
                                 int64_t s_token_stride, int64_t s_group_stride, float eps,
                                 float lo, float hi, bool ue8m0) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (warp >= num_tokens * num_groups) return;
  const int64_t t = warp / num_groups, g = warp % num_groups;
  const T* x = in + t * in_stride + g * group_size;
  uint8_t* o = out + t * out_stride + g * group_size;
  float m = 0.f;
  for (int64_t i = lane; i < group_size; i += kWarpSize) m = fmaxf(m, fabsf(to_float(x[i])));
  float s = fmaxf(warp_reduce_max(m), eps) / hi;
  if (ue8m0) s = exp2f(ceilf(log2f(s)));
  if (lane == 0) scales[t * s_token_stride + g * s_group_stride] = s;
  for (int64_t i = lane; i < group_size; i += kWarpSize)
    o[i] = quant_fp8(to_float(x[i]), s, lo, hi);
}

}  // namespace pyorch::kernels
