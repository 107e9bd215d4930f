// random_sample_from_logits (pyorch/sampling.h): one token per row by the exponential race over
// the raw logits, in one pass.
//
// The engine's unfused draw (pyorch/layers/sampler.py) makes a float32 copy of the logits, divides
// by the temperature, fills a [rows, vocab] tensor with Exp(1) noise, takes its log and
// subtracts it, then reduces: about seven passes over [rows, vocab] float32 (at 1,000 rows of a
// 128k vocabulary, ~0.5 GB each). Here a CTA owns a row: each thread walks groups of four
// consecutive logits (one Philox call gives their four uniform words), keeps its best (score,
// index), and the CTA reduces them; the logits are read once, nothing else is written.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/check.cuh"
#include "common/dtype.cuh"
#include "pyorch/philox.h"

namespace pyorch::kernels {

constexpr int kSampleThreads = 512;

// a is better than b: a NaN beats any number (torch.argmax's rule), a larger value beats a
// smaller one, and between equals the lower index wins.
__device__ __forceinline__ bool sample_better(float av, int ai, float bv, int bi) {
  const bool a_nan = av != av;
  const bool b_nan = bv != bv;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && av != bv) return av > bv;
  return ai < bi;
}

// The warp's best (value, index) by sample_better, in every lane.
__device__ __forceinline__ void warp_reduce_best(float& best, int& best_idx) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, best_idx, offset);
    if (sample_better(ov, oi, best, best_idx)) {
      best = ov;
      best_idx = oi;
    }
  }
}

// The score of logit x (already a float) with its uniform word: x / t - log(-log(u)).
__device__ __forceinline__ float race_score(float x, float t, uint32_t word) {
  const float q = -logf(philox::uniform_open(word));
  return x / t - logf(q);
}

// grid: num_rows CTAs; block: kSampleThreads. VEC: the row's groups of four are 4-element aligned
// (4 * sizeof(T) bytes) and whole, so each is one vector load.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kSampleThreads)
    random_sample_kernel(int64_t* __restrict__ out, const T* __restrict__ logits,
                         const float* __restrict__ temperature, const int64_t* __restrict__ seeds,
                         int vocab_size, int64_t logits_stride) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * logits_stride;
  const float t = temperature[row];
  const bool greedy = !(t > 0.f);
  const uint64_t seed = static_cast<uint64_t>(seeds[row]);
  float best = -INFINITY;
  int best_idx = INT32_MAX;
  const int num_groups = (vocab_size + 3) / 4;
  for (int g = threadIdx.x; g < num_groups; g += kSampleThreads) {
    const int j0 = 4 * g;
    float v[4];
    if constexpr (VEC) {
      if constexpr (sizeof(T) == 4) {
        const float4 w = *reinterpret_cast<const float4*>(x + j0);
        v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(x + j0);
        const T* h = reinterpret_cast<const T*>(&w);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = to_float(h[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = j0 + e < vocab_size ? to_float(x[j0 + e]) : -INFINITY;
    }
    if (greedy) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (j0 + e < vocab_size && sample_better(v[e], j0 + e, best, best_idx)) {
          best = v[e];
          best_idx = j0 + e;
        }
      }
    } else {
      const philox::U32x4 words = philox::token_words(seed, static_cast<uint64_t>(g));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float s = race_score(v[e], t, words.v[e]);
        if (j0 + e < vocab_size && sample_better(s, j0 + e, best, best_idx)) {
          best = s;
          best_idx = j0 + e;
        }
      }
    }
  }
  warp_reduce_best(best, best_idx);
  constexpr int kWarps = kSampleThreads / 32;
  __shared__ float warp_best[kWarps];
  __shared__ int warp_idx[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_idx[warp] = best_idx;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? warp_best[lane] : -INFINITY;
    best_idx = lane < kWarps ? warp_idx[lane] : INT32_MAX;
    warp_reduce_best(best, best_idx);
    // Every candidate lost to INT32_MAX's -inf only if the row is all -inf: index 0, as argmax.
    if (lane == 0) out[row] = best_idx == INT32_MAX ? 0 : best_idx;
  }
}

template <typename T>
cudaError_t launch_random_sample(int64_t* out, const T* logits, const float* temperature,
                                 const int64_t* seeds, int64_t num_rows, int64_t vocab_size,
                                 int64_t logits_stride, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (vocab_size < 1 || vocab_size > INT32_MAX - 4) {
    PYORCH_INVALID("random_sample_from_logits: vocab_size %lld out of range",
                   static_cast<long long>(vocab_size));
  }
  if (num_rows > INT32_MAX) {
    PYORCH_INVALID("random_sample_from_logits: %lld rows", static_cast<long long>(num_rows));
  }
  const bool vec = vocab_size % 4 == 0 && logits_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(logits) % (4 * sizeof(T)) == 0;
  const dim3 grid(static_cast<unsigned>(num_rows));
  if (vec) {
    random_sample_kernel<T, true><<<grid, kSampleThreads, 0, stream>>>(
        out, logits, temperature, seeds, static_cast<int>(vocab_size), logits_stride);
  } else {
    random_sample_kernel<T, false><<<grid, kSampleThreads, 0, stream>>>(
        out, logits, temperature, seeds, static_cast<int>(vocab_size), logits_stride);
  }
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
