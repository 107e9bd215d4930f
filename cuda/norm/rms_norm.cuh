// RMSNorm kernels: one thread block per token row, fp32 accumulation, 16-byte vector access.
#pragma once

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"

namespace pyorch::kernels {

constexpr int kNormThreads = 256;

// Pass 1 reads the row to get the sum of squares; pass 2 re-reads it (from L1/L2, rows are at most
// a few tens of KB) and writes the scaled output. Both kernels launch with PDL (common/launch.cuh):
// they wait for the kernel before them first, then let the next one (typically a GEMM streaming
// its weights) be scheduled.
template <typename T, int VEC_SIZE>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(T* __restrict__ out,           // [num_tokens, hidden_size]
                    const T* __restrict__ in,      // [num_tokens, hidden_size]
                    const T* __restrict__ weight,  // [hidden_size]
                    int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps) {
  using V = Vec<T, VEC_SIZE>;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const T* x = in + row * in_stride;
  T* y = out + row * out_stride;
  const int64_t num_vecs = hidden_size / VEC_SIZE;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    V v;
    v.load(x + i * VEC_SIZE);
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      const float f = to_float(v.data[j]);
      sum_sq += f * f;
    }
  }
  sum_sq = block_reduce_sum<kNormThreads>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden_size) + eps);

  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    V v, w, o;
    v.load(x + i * VEC_SIZE);
    w.load(weight + i * VEC_SIZE);
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      // Round the normalized value to T before the weight multiply, as HF's LlamaRMSNorm does.
      const float normed = to_float(from_float<T>(to_float(v.data[j]) * inv_rms));
      o.data[j] = from_float<T>(normed * to_float(w.data[j]));
    }
    o.store(y + i * VEC_SIZE);
  }
}

// The first kNormCached vectors of each thread stay in registers between the two passes (all of
// them up to hidden_size = kNormThreads * kNormCached * VEC_SIZE, 8192 in bf16), and their weight
// vectors are loaded before pdl_wait(): weights are constants, so that load overlaps the previous
// kernel's tail instead of adding a memory round trip after it.
constexpr int kNormCached = 4;

template <typename T, int VEC_SIZE>
__global__ void __launch_bounds__(kNormThreads)
    fused_add_rms_norm_kernel(T* __restrict__ input,         // [num_tokens, hidden_size]
                              T* __restrict__ residual,      // [num_tokens, hidden_size]
                              const T* __restrict__ weight,  // [hidden_size]
                              int64_t hidden_size, int64_t input_stride, int64_t residual_stride,
                              float eps) {
  using V = Vec<T, VEC_SIZE>;
  const int64_t num_vecs = hidden_size / VEC_SIZE;
  V w_kept[kNormCached], r_kept[kNormCached];
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * kNormThreads;
    if (i < num_vecs) w_kept[k].load(weight + i * VEC_SIZE);
  }
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  T* x = input + row * input_stride;
  T* r = residual + row * residual_stride;

  // residual += input (rounded to T: the residual stream is stored in T), sum of squares.
  auto add = [&](int64_t i, V& rv, float& sum_sq) {
    V xv;
    xv.load(x + i * VEC_SIZE);
    rv.load(r + i * VEC_SIZE);
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      const T s = from_float<T>(to_float(xv.data[j]) + to_float(rv.data[j]));
      rv.data[j] = s;
      const float f = to_float(s);
      sum_sq += f * f;
    }
    rv.store(r + i * VEC_SIZE);
  };
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * kNormThreads;
    if (i < num_vecs) add(i, r_kept[k], sum_sq);
  }
  for (int64_t i = threadIdx.x + int64_t{kNormCached} * kNormThreads; i < num_vecs;
       i += kNormThreads) {
    V rv;
    add(i, rv, sum_sq);
  }
  sum_sq = block_reduce_sum<kNormThreads>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden_size) + eps);

  auto scale = [&](int64_t i, const V& rv, const V& w) {
    V o;
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      const float normed = to_float(from_float<T>(to_float(rv.data[j]) * inv_rms));
      o.data[j] = from_float<T>(normed * to_float(w.data[j]));
    }
    o.store(x + i * VEC_SIZE);
  };
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * kNormThreads;
    if (i < num_vecs) scale(i, r_kept[k], w_kept[k]);
  }
  // Past the kept vectors each thread re-reads only the residual chunks it wrote itself: no
  // barrier needed.
  for (int64_t i = threadIdx.x + int64_t{kNormCached} * kNormThreads; i < num_vecs;
       i += kNormThreads) {
    V rv, w;
    rv.load(r + i * VEC_SIZE);
    w.load(weight + i * VEC_SIZE);
    scale(i, rv, w);
  }
}

template <typename T>
cudaError_t launch_rms_norm(T* out, const T* in, const T* weight, int64_t num_tokens,
                            int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps,
                            cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int vec = max_vec_size<T>(hidden_size, {out, in, weight}, {out_stride, in_stride});
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const bool pdl = pdl_enabled();
  switch (vec) {
#define PYORCH_CASE(V)                                                                          \
  case V:                                                                                       \
    return launch_kernel(&rms_norm_kernel<T, V>, grid, dim3(kNormThreads), 0, stream, pdl, out, \
                         in, weight, hidden_size, out_stride, in_stride, eps);
    PYORCH_CASE(1)
    PYORCH_CASE(2)
    PYORCH_CASE(4)
    PYORCH_CASE(8)
#undef PYORCH_CASE
    default: PYORCH_INVALID("rms_norm: bad vector size %d", vec);
  }
}

template <typename T>
cudaError_t launch_fused_add_rms_norm(T* input, T* residual, const T* weight, int64_t num_tokens,
                                      int64_t hidden_size, int64_t input_stride,
                                      int64_t residual_stride, float eps, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int vec =
      max_vec_size<T>(hidden_size, {input, residual, weight}, {input_stride, residual_stride});
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const bool pdl = pdl_enabled();
  switch (vec) {
#define PYORCH_CASE(V)                                                                             \
  case V:                                                                                          \
    return launch_kernel(&fused_add_rms_norm_kernel<T, V>, grid, dim3(kNormThreads), 0, stream,    \
                         pdl, input, residual, weight, hidden_size, input_stride, residual_stride, \
                         eps);
    PYORCH_CASE(1)
    PYORCH_CASE(2)
    PYORCH_CASE(4)
    PYORCH_CASE(8)
#undef PYORCH_CASE
    default: PYORCH_INVALID("fused_add_rms_norm: bad vector size %d", vec);
  }
}

}  // namespace pyorch::kernels
