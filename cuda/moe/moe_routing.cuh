// The small MoE kernels around the expert GEMM: the router's top-k softmax, the sort of (token,
// expert) pairs by expert, and the sum over top_k. None reads a device value on the host, so
// all of them are CUDA-graph safe.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"

namespace pyorch::kernels {

constexpr int kTopkWarps = 4;  // tokens per CTA of topk_softmax: one warp each

// One warp's top_k softmax of one token's gating row. Lane l owns experts l, l + 32, ..., l + 32
// * (PER_LANE - 1) (PER_LANE >= ceil(E / 32), a power of two up to 32: E <= 1024), read into
// registers once, and a bit per owned expert once it is taken; each of the top_k rounds is a
// warp argmax over the untaken ones, ties to the lower expert id. (Reading the row again in
// every round, through L1, cost about twice the kernel's time at 128 experts.) Lane j < top_k
// returns round j's expert and its (renormalized) weight.
template <typename T, int PER_LANE>
__device__ __forceinline__ void topk_softmax_row(const T* row, int num_experts, int top_k,
                                                 bool renormalize, float& weight, int& expert) {
  const int lane = threadIdx.x % kWarpSize;
  float v[PER_LANE];
  float row_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + i * kWarpSize;
    v[i] = e < num_experts ? to_float(row[e]) : -INFINITY;
    row_max = fmaxf(row_max, v[i]);
  }
  row_max = warp_reduce_max(row_max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    if (lane + i * kWarpSize < num_experts) sum += __expf(v[i] - row_max);
  }
  sum = warp_reduce_sum(sum);
  const float inv_sum = 1.f / sum;
  uint32_t taken = 0;
  float selected = 0.f;
  float my_weight = 0.f;  // lane j < top_k keeps round j's result
  int my_expert = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int best_e = num_experts;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + i * kWarpSize;
      if (e < num_experts && !(taken >> i & 1u) && (v[i] > best || best_e == num_experts)) {
        best = v[i];
        best_e = e;
      }
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (other_e < num_experts &&
          (best_e == num_experts || other > best || (other == best && other_e < best_e))) {
        best = other;
        best_e = other_e;
      }
    }
    if (best_e % kWarpSize == lane) taken |= 1u << (best_e / kWarpSize);
    const float p = __expf(best - row_max) * inv_sum;
    selected += p;
    if (lane == j) {
      my_weight = p;
      my_expert = best_e;
    }
  }
  weight = renormalize && selected > 0.f ? my_weight / selected : my_weight;
  expert = my_expert;
}

// One warp per token (topk_softmax_row).
template <typename T, typename IndexT, int PER_LANE>
__global__ void topk_softmax_kernel(float* __restrict__ topk_weights,    // [M, top_k]
                                    IndexT* __restrict__ topk_indices,   // [M, top_k]
                                    int32_t* __restrict__ token_expert,  // [M, top_k]
                                    const T* __restrict__ gating,        // [M, E], row stride
                                    int num_tokens, int num_experts, int top_k,
                                    int64_t gating_stride, bool renormalize) {
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kTopkWarps + threadIdx.x / kWarpSize;
  if (token >= num_tokens) return;
  float weight;
  int expert;
  topk_softmax_row<T, PER_LANE>(gating + token * gating_stride, num_experts, top_k, renormalize,
                                weight, expert);
  if (lane < top_k) {
    const int64_t o = static_cast<int64_t>(token) * top_k + lane;
    topk_weights[o] = weight;
    topk_indices[o] = static_cast<IndexT>(expert);
    token_expert[o] = lane * num_tokens + token;
  }
}

// ---- the router GEMM and topk_softmax in one launch, for a few tokens ---------------------------
// Warp w of CTA b computes expert e = b * kRouterTopkWarps + w's logits for all M tokens: its
// gate row (H elements, 16-byte loads across the lanes, asked of L2 before pdl_wait) against
// each token's row, fp32 sums rounded to T, written to router_logits. The CTAs then count
// themselves in on *counter; the last one (it sees every CTA's logits after the fences) stages
// the [M, E] logits in shared memory, runs topk_softmax_row per token (one warp each) and sets
// the counter back to 0 for the next launch (graph replays included).
constexpr int kRouterTopkWarps = 4;
constexpr int kRouterTopkMaxTokens = 8;
constexpr int kRouterTopkAlign = 8;  // H and the row stride: multiples of a 16-byte load of T

template <typename T, int PER_LANE>
__global__ void __launch_bounds__(kRouterTopkWarps* kWarpSize)
    moe_router_topk_kernel(float* __restrict__ topk_weights,  // [M, top_k]
                           int32_t* __restrict__ topk_ids,    // [M, top_k]
                           T* router_logits,                  // [M, E]: written, then re-read
                           const T* __restrict__ hidden,      // [M, H], row stride hidden_stride
                           const T* __restrict__ gate,        // [E, H]
                           int32_t* counter,                  // [1], 0 between launches
                           int num_tokens, int num_experts, int hidden_size, int64_t hidden_stride,
                           int top_k, bool renormalize) {
  __shared__ T staged[kRouterTopkMaxTokens * kWarpSize * PER_LANE];
  __shared__ bool is_last;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int e = blockIdx.x * kRouterTopkWarps + warp;
  const T* w_row = gate + static_cast<int64_t>(min(e, num_experts - 1)) * hidden_size;
  constexpr int kLine = 128 / static_cast<int>(sizeof(T));  // elements per 128-byte line
  for (int k = lane * kLine; k < hidden_size; k += kWarpSize * kLine) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w_row + k));  // weights are constants
  }
  pdl_wait();  // hidden is the previous kernel's output
  pdl_launch_dependents();
  if (e < num_experts) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    float acc[kRouterTopkMaxTokens] = {};
    for (int k = lane * kVec; k < hidden_size; k += kWarpSize * kVec) {
      Vec<T, kVec> w;
      w.load(w_row + k);
#pragma unroll
      for (int m = 0; m < kRouterTopkMaxTokens; ++m) {
        if (m >= num_tokens) break;
        Vec<T, kVec> x;
        x.load(hidden + m * hidden_stride + k);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          acc[m] = fmaf(to_float(w.data[j]), to_float(x.data[j]), acc[m]);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kRouterTopkMaxTokens; ++m) {
      if (m >= num_tokens) break;
      const float sum = warp_reduce_sum(acc[m]);
      if (lane == 0) router_logits[m * num_experts + e] = from_float<T>(sum);
    }
  }
  __threadfence();  // this CTA's logits are visible device-wide before it counts itself in
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Every CTA's logits, through L2 (ld.global.cg: not this SM's L1, which may hold none of them).
  const int num_logits = num_tokens * num_experts;
  for (int i = threadIdx.x; i < num_logits; i += blockDim.x) {
    staged[i] = __ldcg(router_logits + i);
  }
  __syncthreads();
  for (int m = warp; m < num_tokens; m += kRouterTopkWarps) {
    float weight;
    int expert;
    topk_softmax_row<T, PER_LANE>(staged + m * num_experts, num_experts, top_k, renormalize, weight,
                                  expert);
    if (lane < top_k) {
      topk_weights[m * top_k + lane] = weight;
      topk_ids[m * top_k + lane] = expert;
    }
  }
  if (threadIdx.x == 0) *counter = 0;
}

constexpr int kAlignThreads = 1024;

// One CTA: count pairs per expert (shared atomics), prefix-sum the padded counts, fill the
// padding, then scatter each pair to its expert's next slot. The order of pairs within an
// expert is unspecified (the GEMM does not care). Shared memory: 2 * (E + 1) int32.
template <typename IdT>
__global__ void moe_align_block_size_kernel(const IdT* __restrict__ topk_ids,        // [num_flat]
                                            int32_t* __restrict__ sorted_token_ids,  // [num_sorted]
                                            int32_t* __restrict__ expert_ids,        // [num_blocks]
                                            int32_t* __restrict__ num_post_pad,      // [1]
                                            const int32_t* __restrict__ expert_map,  // [E] or null
                                            int num_flat, int num_experts, int block_size,
                                            int num_sorted, int num_blocks) {
  extern __shared__ int32_t align_smem[];
  int32_t* counts = align_smem;                // [E]: pairs per expert, then the fill cursor
  int32_t* starts = align_smem + num_experts;  // [E + 1]: padded prefix sums
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int f = threadIdx.x; f < num_flat; f += blockDim.x) {
    const int64_t e = static_cast<int64_t>(topk_ids[f]);
    if (e >= 0 && e < num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // starts = exclusive prefix sum of the padded counts: thread e holds expert e's (blockDim.x >=
  // num_experts), a shuffle scan per warp, then one over the warps' totals. (A serial loop on one
  // thread cost ~7 us at 128 experts, more than the rest of the kernel.)
  {
    __shared__ int32_t warp_totals[kAlignThreads / kWarpSize];
    const int e = threadIdx.x;
    const int lane = e % kWarpSize;
    const int warp = e / kWarpSize;
    const int32_t padded =
        e < num_experts ? (counts[e] + block_size - 1) / block_size * block_size : 0;
    int32_t incl = padded;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int32_t other = __shfl_up_sync(0xffffffffu, incl, offset);
      if (lane >= offset) incl += other;
    }
    if (lane == kWarpSize - 1) warp_totals[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int32_t total = lane < static_cast<int>(blockDim.x / kWarpSize) ? warp_totals[lane] : 0;
#pragma unroll
      for (int offset = 1; offset < kWarpSize; offset *= 2) {
        const int32_t other = __shfl_up_sync(0xffffffffu, total, offset);
        if (lane >= offset) total += other;
      }
      warp_totals[lane] = total;  // inclusive over warps 0..lane
    }
    __syncthreads();
    const int32_t before = (warp > 0 ? warp_totals[warp - 1] : 0) + incl - padded;
    if (e < num_experts) starts[e] = before;
    if (e == num_experts - 1) {
      starts[num_experts] = before + padded;
      *num_post_pad = before + padded;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_sorted; i += blockDim.x) sorted_token_ids[i] = num_flat;
  for (int b = threadIdx.x; b < num_blocks; b += blockDim.x) expert_ids[b] = -1;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int32_t id = expert_map ? expert_map[e] : e;
    for (int b = starts[e] / block_size; b < starts[e + 1] / block_size; ++b) expert_ids[b] = id;
    counts[e] = starts[e];  // the fill cursor
  }
  __syncthreads();
  for (int f = threadIdx.x; f < num_flat; f += blockDim.x) {
    const int64_t e = static_cast<int64_t>(topk_ids[f]);
    if (e >= 0 && e < num_experts) sorted_token_ids[atomicAdd(&counts[e], 1)] = f;
  }
}

constexpr int kMoeSumThreads = 256;

// grid (M, ceil(H / kMoeSumThreads)): output[m, h] = sum_j input[m, j, h], fp32, rounded once.
template <typename T>
__global__ void moe_sum_kernel(T* __restrict__ output,       // [M, H]
                               const T* __restrict__ input,  // [M, top_k, H]
                               int top_k, int hidden_size) {
  const int h = blockIdx.y * kMoeSumThreads + threadIdx.x;
  if (h >= hidden_size) return;
  const int64_t m = blockIdx.x;
  const T* in = input + m * top_k * hidden_size + h;
  float acc = 0.f;
  for (int j = 0; j < top_k; ++j) acc += to_float(in[static_cast<int64_t>(j) * hidden_size]);
  output[m * hidden_size + h] = from_float<T>(acc);
}

}  // namespace pyorch::kernels
