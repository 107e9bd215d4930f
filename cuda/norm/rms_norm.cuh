// RMSNorm kernels: one thread block per token row, fp32 accumulation, 16-byte vector access.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"

namespace pyorch::kernels {

constexpr int kNormThreads = 256;

// Pass 1 reads the row to get the sum of squares; pass 2 re-reads it (from L1/L2, rows are at most
// a few tens of KB) and writes the scaled output.
template <typename T, int VEC_SIZE>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(T* __restrict__ out,           // [num_tokens, hidden_size]
                    const T* __restrict__ in,      // [num_tokens, hidden_size]
                    const T* __restrict__ weight,  // [hidden_size]
                    int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps) {
  using V = Vec<T, VEC_SIZE>;
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

template <typename T, int VEC_SIZE>
__global__ void __launch_bounds__(kNormThreads)
    fused_add_rms_norm_kernel(T* __restrict__ input,         // [num_tokens, hidden_size]
                              T* __restrict__ residual,      // [num_tokens, hidden_size]
                              const T* __restrict__ weight,  // [hidden_size]
                              int64_t hidden_size, int64_t input_stride,
                              int64_t residual_stride, float eps) {
  using V = Vec<T, VEC_SIZE>;
  const int64_t row = blockIdx.x;
  T* x = input + row * input_stride;
  T* r = residual + row * residual_stride;
  const int64_t num_vecs = hidden_size / VEC_SIZE;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    V xv, rv;
    xv.load(x + i * VEC_SIZE);
    rv.load(r + i * VEC_SIZE);
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      // The sum is rounded to T first: the residual stream is stored in T.
      const T s = from_float<T>(to_float(xv.data[j]) + to_float(rv.data[j]));
      rv.data[j] = s;
      const float f = to_float(s);
      sum_sq += f * f;
    }
    rv.store(r + i * VEC_SIZE);
  }
  sum_sq = block_reduce_sum<kNormThreads>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden_size) + eps);

  // Each thread re-reads only the residual chunks it wrote itself: no barrier needed.
  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    V rv, w, o;
    rv.load(r + i * VEC_SIZE);
    w.load(weight + i * VEC_SIZE);
#pragma unroll
    for (int j = 0; j < VEC_SIZE; ++j) {
      const float normed = to_float(from_float<T>(to_float(rv.data[j]) * inv_rms));
      o.data[j] = from_float<T>(normed * to_float(w.data[j]));
    }
    o.store(x + i * VEC_SIZE);
  }
}

template <typename T>
cudaError_t launch_rms_norm(T* out, const T* in, const T* weight, int64_t num_tokens,
                            int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps,
                            cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int vec = max_vec_size<T>(hidden_size, {out, in, weight}, {out_stride, in_stride});
  const dim3 grid(static_cast<unsigned>(num_tokens));
  switch (vec) {
#define PYORCH_CASE(V)                                                                    \
  case V:                                                                                 \
    rms_norm_kernel<T, V><<<grid, kNormThreads, 0, stream>>>(out, in, weight, hidden_size, \
                                                             out_stride, in_stride, eps); \
    break;
    PYORCH_CASE(1) PYORCH_CASE(2) PYORCH_CASE(4) PYORCH_CASE(8)
#undef PYORCH_CASE
    default: PYORCH_INVALID("rms_norm: bad vector size %d", vec);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fused_add_rms_norm(T* input, T* residual, const T* weight, int64_t num_tokens,
                                      int64_t hidden_size, int64_t input_stride,
                                      int64_t residual_stride, float eps, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int vec =
      max_vec_size<T>(hidden_size, {input, residual, weight}, {input_stride, residual_stride});
  const dim3 grid(static_cast<unsigned>(num_tokens));
  switch (vec) {
#define PYORCH_CASE(V)                                                           \
  case V:                                                                        \
    fused_add_rms_norm_kernel<T, V><<<grid, kNormThreads, 0, stream>>>(           \
        input, residual, weight, hidden_size, input_stride, residual_stride, eps); \
    break;
    PYORCH_CASE(1) PYORCH_CASE(2) PYORCH_CASE(4) PYORCH_CASE(8)
#undef PYORCH_CASE
    default: PYORCH_INVALID("fused_add_rms_norm: bad vector size %d", vec);
  }
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
