// The small MoE kernels around the expert GEMM: the router's top-k softmax, the sort of (token,
// expert) pairs by expert, and the sum over top_k. None reads a device value on the host, so
// all of them are CUDA-graph safe.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"

namespace pyorch::kernels {

constexpr int kTopkWarps = 4;  // tokens per CTA of topk_softmax: one warp each

// A 16-bit float logit and its expert as one 32-bit key whose unsigned order is the argmax's:
// the value's bits made order-preserving (sign flipped for positives, all bits for negatives;
// -0 as +0) above 0xffff - expert (ties to the lower id). 0 is below every expert's key.
__device__ __forceinline__ uint32_t topk_key(uint16_t bits, int expert) {
  if (bits == 0x8000u) bits = 0;
  const uint32_t ordered = (bits & 0x8000u) ? (~bits & 0xffffu) : (bits | 0x8000u);
  return (ordered << 16) | (0xffffu - static_cast<uint32_t>(expert));
}

template <typename T>
__device__ __forceinline__ float topk_key_value(uint32_t key) {
  const uint32_t ordered = key >> 16;
  const uint16_t bits =
      static_cast<uint16_t>((ordered & 0x8000u) ? (ordered & 0x7fffu) : (~ordered & 0xffffu));
  T value;
  memcpy(&value, &bits, sizeof(bits));
  return to_float(value);
}

// One warp per token. Lane l owns experts l, l + 32, ..., l + 32 * (PER_LANE - 1) (PER_LANE >=
// ceil(E / 32), a power of two up to 32: E <= 1024), read into registers once, and a bit per
// owned expert once it is taken; each of the top_k rounds is a warp argmax over the untaken ones,
// ties to the lower expert id. (Reading the row again in every round, through L1, cost about
// twice the kernel's time at 128 experts.) 16-bit logits (the router GEMM's output in a bf16 or
// fp16 model) take the argmax as one redux.sync over 32-bit keys (topk_key) instead of five
// rounds of two shuffles: the top_k rounds are the kernel's critical path at decode.
template <typename T, typename IndexT, int PER_LANE>
__global__ void topk_softmax_kernel(float* __restrict__ topk_weights,    // [M, top_k]
                                    IndexT* __restrict__ topk_indices,   // [M, top_k]
                                    int32_t* __restrict__ token_expert,  // [M, top_k]
                                    const T* __restrict__ gating,        // [M, E], row stride
                                    int num_tokens, int num_experts, int top_k,
                                    int64_t gating_stride, bool renormalize) {
  // Launched with PDL (topk_softmax): the logits are the router GEMM's output; the kernels after
  // (the sort, or the decode pair's gate_up) wait on this one in turn.
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kTopkWarps + threadIdx.x / kWarpSize;
  if (token >= num_tokens) return;
  const T* row = gating + token * gating_stride;
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
  float selected = 0.f;
  float my_weight = 0.f;  // lane j < top_k keeps round j's result
  int my_expert = 0;
  if constexpr (sizeof(T) == 2) {
    uint32_t key[PER_LANE];  // 0 once taken (or past E)
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + i * kWarpSize;
      key[i] = e < num_experts ? topk_key(*reinterpret_cast<const uint16_t*>(row + e), e) : 0u;
    }
    for (int j = 0; j < top_k; ++j) {
      uint32_t mine = 0;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) mine = max(mine, key[i]);
      const uint32_t top = __reduce_max_sync(0xffffffffu, mine);
      const int best_e = static_cast<int>(0xffffu - (top & 0xffffu));
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        if (lane + i * kWarpSize == best_e) key[i] = 0u;
      }
      const float p = __expf(topk_key_value<T>(top) - row_max) * inv_sum;
      selected += p;
      if (lane == j) {
        my_weight = p;
        my_expert = best_e;
      }
    }
  } else {
    uint32_t taken = 0;
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
  }
  if (lane < top_k) {
    const int64_t o = static_cast<int64_t>(token) * top_k + lane;
    topk_weights[o] = renormalize && selected > 0.f ? my_weight / selected : my_weight;
    topk_indices[o] = static_cast<IndexT>(my_expert);
    token_expert[o] = lane * num_tokens + token;
  }
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
