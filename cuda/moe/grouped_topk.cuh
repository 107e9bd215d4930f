// grouped_topk (vLLM's, the DeepSeek-V2/V3 router): expert groups, a per-group score, the best
// topk_group groups, then the top_k experts among them. Contract in pyorch/moe_decode.h.
//
// One warp per token. The token's scores and choices (scores + correction bias) sit in shared
// memory; lane g scores group g (num_groups <= 32); the group rounds and the expert rounds are
// warp argmaxes, ties to the lower index, as in topk_softmax. Lane j keeps expert round j.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "pyorch/moe_decode.h"

namespace pyorch::kernels {

constexpr int kGroupedTopkWarps = 4;
constexpr int kGroupedTopkMaxExperts = 1024;

// Warp argmax of (value, index) over the lanes, index < limit valid; ties to the lower index.
__device__ __forceinline__ void warp_argmax(float& best, int& best_i, int limit) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (other_i < limit &&
        (best_i >= limit || other > best || (other == best && other_i < best_i))) {
      best = other;
      best_i = other_i;
    }
  }
}

template <typename T, typename IndexT>
__global__ void grouped_topk_kernel(float* __restrict__ topk_weights, IndexT* __restrict__ topk_ids,
                                    const T* __restrict__ gating, const float* __restrict__ bias,
                                    int num_tokens, int num_experts, int top_k, int num_groups,
                                    int topk_group, int64_t gating_stride, bool renormalize,
                                    MoeScoring scoring, float routed_scaling_factor) {
  __shared__ float scores_all[kGroupedTopkWarps][kGroupedTopkMaxExperts];
  __shared__ float choice_all[kGroupedTopkWarps][kGroupedTopkMaxExperts];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int token = blockIdx.x * kGroupedTopkWarps + warp;
  if (token >= num_tokens) return;
  float* scores = scores_all[warp];
  float* choice = choice_all[warp];
  const T* row = gating + token * gating_stride;
  float row_max = -INFINITY;
  if (scoring == MoeScoring::kSoftmax) {
    for (int e = lane; e < num_experts; e += kWarpSize) row_max = fmaxf(row_max, to_float(row[e]));
    row_max = warp_reduce_max(row_max);
  }
  float sum = 0.f;
  for (int e = lane; e < num_experts; e += kWarpSize) {
    const float x = to_float(row[e]);
    const float s = scoring == MoeScoring::kSoftmax ? expf(x - row_max) : 1.f / (1.f + expf(-x));
    scores[e] = s;
    sum += s;
  }
  if (scoring == MoeScoring::kSoftmax) {
    const float inv = 1.f / warp_reduce_sum(sum);
    for (int e = lane; e < num_experts; e += kWarpSize) scores[e] *= inv;
  }
  for (int e = lane; e < num_experts; e += kWarpSize) {
    choice[e] = bias != nullptr ? scores[e] + bias[e] : scores[e];
  }
  __syncwarp();
  // Group scores: lane g owns group g.
  const int group_size = num_experts / num_groups;
  float group_score = -INFINITY;
  if (lane < num_groups) {
    float first = -INFINITY, second = -INFINITY;
    for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
      const float c = choice[e];
      if (c > first) {
        second = first;
        first = c;
      } else if (c > second) {
        second = c;
      }
    }
    group_score = bias != nullptr ? first + second : first;
  }
  uint32_t groups = 0;  // bit g: group g kept
  for (int r = 0; r < topk_group; ++r) {
    float best = (lane < num_groups && !(groups >> lane & 1u)) ? group_score : -INFINITY;
    int best_i = (lane < num_groups && !(groups >> lane & 1u)) ? lane : num_groups;
    warp_argmax(best, best_i, num_groups);
    groups |= 1u << best_i;
  }
  uint32_t taken = 0;  // bit i: expert lane + 32 i taken
  float selected = 0.f;
  float my_weight = 0.f;
  int my_expert = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int best_e = num_experts;
    for (int i = 0, e = lane; e < num_experts; ++i, e += kWarpSize) {
      if ((taken >> i & 1u) || !(groups >> (e / group_size) & 1u)) continue;
      if (best_e == num_experts || choice[e] > best) {
        best = choice[e];
        best_e = e;
      }
    }
    warp_argmax(best, best_e, num_experts);
    if (best_e % kWarpSize == lane) taken |= 1u << (best_e / kWarpSize);
    const float w = scores[best_e];
    selected += w;
    if (lane == j) {
      my_weight = w;
      my_expert = best_e;
    }
  }
  if (lane < top_k) {
    const int64_t o = static_cast<int64_t>(token) * top_k + lane;
    const float w = renormalize && selected > 0.f ? my_weight / selected : my_weight;
    topk_weights[o] = w * routed_scaling_factor;
    topk_ids[o] = static_cast<IndexT>(my_expert);
  }
}

}  // namespace pyorch::kernels
