// Log-sum-exp merges of partial attention outputs: the public merge_attn_states (two parts) and
// the combine step of paged_attention's split-KV path (num_splits parts). One warp per
// (token, head), lanes across the head dimension.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"

namespace pyorch::kernels {

constexpr int kMergeWarps = 4;
constexpr int kMergeThreads = kMergeWarps * kWarpSize;

// FlashAttention-2 reports +inf for an empty part, FlashAttention-3 -inf: both mean "no keys".
__device__ __forceinline__ float empty_part_as_neg_inf(float lse) {
  return isinf(lse) ? -INFINITY : lse;
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_attn_states_kernel(
    T* __restrict__ output,                // [num_tokens, num_heads, head_size]
    float* __restrict__ output_lse,        // [num_heads, num_tokens] or null
    const T* __restrict__ prefix_output,   // [num_tokens, num_heads, head_size]
    const float* __restrict__ prefix_lse,  // [num_heads, num_tokens]
    const T* __restrict__ suffix_output,   // [num_tokens, num_heads, head_size]
    const float* __restrict__ suffix_lse,  // [num_heads, num_tokens]
    int64_t num_tokens, int64_t num_heads, int64_t head_size, int64_t out_token_stride,
    int64_t out_head_stride, int64_t prefix_token_stride, int64_t prefix_head_stride,
    int64_t suffix_token_stride, int64_t suffix_head_stride, int64_t lse_head_stride) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (pair >= num_tokens * num_heads) return;
  const int64_t token = pair / num_heads;
  const int64_t head = pair % num_heads;
  const float p_lse = empty_part_as_neg_inf(prefix_lse[head * lse_head_stride + token]);
  const float s_lse = empty_part_as_neg_inf(suffix_lse[head * lse_head_stride + token]);
  const float max_lse = fmaxf(p_lse, s_lse);
  T* out = output + token * out_token_stride + head * out_head_stride;
  if (max_lse == -INFINITY) {  // both parts empty: zeros, not 0/0
    for (int64_t d = lane; d < head_size; d += kWarpSize) out[d] = from_float<T>(0.f);
    if (output_lse != nullptr && lane == 0) output_lse[head * lse_head_stride + token] = -INFINITY;
    return;
  }
  const float p_se = expf(p_lse - max_lse);
  const float s_se = expf(s_lse - max_lse);
  const float sum = p_se + s_se;
  const float p_scale = p_se / sum;
  const float s_scale = s_se / sum;
  const T* p_out = prefix_output + token * prefix_token_stride + head * prefix_head_stride;
  const T* s_out = suffix_output + token * suffix_token_stride + head * suffix_head_stride;
  for (int64_t d = lane; d < head_size; d += kWarpSize) {
    // An empty part's output may be garbage (even NaN): skip it rather than multiply it by 0.
    float acc = 0.f;
    if (p_se > 0.f) acc += to_float(p_out[d]) * p_scale;
    if (s_se > 0.f) acc += to_float(s_out[d]) * s_scale;
    out[d] = from_float<T>(acc);
  }
  if (output_lse != nullptr && lane == 0) {
    output_lse[head * lse_head_stride + token] = logf(sum) + max_lse;
  }
}

// Cascade attention's merge, in place: out[rows[i]] (a row's suffix attention, with suffix_lse)
// becomes the log-sum-exp merge of it and prefix_output[i] (its group's shared prefix, with
// prefix_lse), for i < num_rows. One warp per (i, head); each lane reads its dims of the suffix
// before it writes them, so `out` is both input and output. Rows outside [0, num_tokens) are
// skipped (the adapter checks them on the CPU; on the GPU they would cost a synchronization).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_prefix_into_rows_kernel(
    T* out,                                // [num_tokens, num_heads, head_size]
    const float* __restrict__ suffix_lse,  // [num_heads, suffix_lse_head_stride]
    const T* __restrict__ prefix_output,   // [num_rows, num_heads, head_size]
    const float* __restrict__ prefix_lse,  // [num_heads, prefix_lse_head_stride]
    const int64_t* __restrict__ rows,      // [num_rows]
    int64_t num_rows, int64_t num_tokens, int64_t num_heads, int64_t head_size,
    int64_t out_token_stride, int64_t out_head_stride, int64_t prefix_token_stride,
    int64_t prefix_head_stride, int64_t suffix_lse_head_stride, int64_t prefix_lse_head_stride) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (pair >= num_rows * num_heads) return;
  const int64_t i = pair / num_heads;
  const int64_t head = pair % num_heads;
  const int64_t row = rows[i];
  if (row < 0 || row >= num_tokens) return;
  const float p_lse = empty_part_as_neg_inf(prefix_lse[head * prefix_lse_head_stride + i]);
  const float s_lse = empty_part_as_neg_inf(suffix_lse[head * suffix_lse_head_stride + row]);
  const float max_lse = fmaxf(p_lse, s_lse);
  T* o = out + row * out_token_stride + head * out_head_stride;
  if (max_lse == -INFINITY) {
    for (int64_t d = lane; d < head_size; d += kWarpSize) o[d] = from_float<T>(0.f);
    return;
  }
  const float p_se = expf(p_lse - max_lse);
  const float s_se = expf(s_lse - max_lse);
  const float inv = 1.f / (p_se + s_se);
  const T* p_out = prefix_output + i * prefix_token_stride + head * prefix_head_stride;
  for (int64_t d = lane; d < head_size; d += kWarpSize) {
    float acc = 0.f;
    if (p_se > 0.f) acc += to_float(p_out[d]) * (p_se * inv);
    if (s_se > 0.f) acc += to_float(o[d]) * (s_se * inv);
    o[d] = from_float<T>(acc);
  }
}

// At most this many partials per row: each lane keeps the weights of two splits in registers.
constexpr int kMaxKvSplits = 2 * kWarpSize;

// out[token, head] = sum_s e^{lse_s - M} o_s / sum_s e^{lse_s - M} over the num_splits partials of
// paged_attention, for tokens in [query_start_loc[0], query_start_loc[num_seqs]) only: the rows
// past it are padding and stay untouched. Lane s computes split s's weight once; the loop over
// splits then only broadcasts weights and issues independent 16-byte loads (unrolled by 16, so a
// decode call's splits are all in flight). An empty split wrote lse -inf and zeros, so its
// weight 0 needs no special case.
// Launched with programmatic dependent launch behind the attention kernel (common/launch.cuh):
// pdl_wait holds it until that grid has finished and its partials are visible.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_split_kv_kernel(
    T* __restrict__ out,                          // [num_tokens, num_heads, head_size]
    const float* __restrict__ o_partial,          // [num_splits, num_tokens, num_heads, head_size]
    const float* __restrict__ lse_partial,        // [num_splits, num_tokens, num_heads]
    const int32_t* __restrict__ query_start_loc,  // [num_seqs + 1]
    int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t head_size, int num_splits,
    int64_t out_token_stride, int64_t out_head_stride,
    float* __restrict__ out_lse,  // optional [num_heads, lse_head_stride]: the merged lse
    int64_t lse_head_stride) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (pair >= num_tokens * num_heads) return;
  const int64_t token = pair / num_heads;
  const int64_t head = pair % num_heads;
  if (token < query_start_loc[0] || token >= query_start_loc[num_seqs]) return;
  const int64_t split_stride = num_tokens * num_heads;
  const float lse0 = lane < num_splits ? lse_partial[lane * split_stride + pair] : -INFINITY;
  const float lse1 = lane + kWarpSize < num_splits
                         ? lse_partial[(lane + kWarpSize) * split_stride + pair]
                         : -INFINITY;
  const float max_lse = warp_reduce_max(fmaxf(lse0, lse1));
  T* dst = out + token * out_token_stride + head * out_head_stride;
  if (max_lse == -INFINITY) {  // no split saw a key (cannot happen for a causal query)
    for (int64_t d = lane; d < head_size; d += kWarpSize) dst[d] = from_float<T>(0.f);
    if (out_lse != nullptr && lane == 0) out_lse[head * lse_head_stride + token] = -INFINITY;
    return;
  }
  const float w0 = expf(lse0 - max_lse);  // 0 for an empty split or a lane past num_splits
  const float w1 = expf(lse1 - max_lse);
  const float total = warp_reduce_sum(w0 + w1);
  const float inv_sum = 1.f / total;
  if (out_lse != nullptr && lane == 0)
    out_lse[head * lse_head_stride + token] = max_lse + logf(total);
  // 4 dims per lane and load (head_size % 4 == 0: the launcher checks it).
  const float4* src = reinterpret_cast<const float4*>(o_partial + pair * head_size);
  const int64_t num_vec = head_size / 4;
  const int64_t vec_split_stride = split_stride * num_vec;
  for (int64_t v0 = 0; v0 < num_vec; v0 += kWarpSize) {  // uniform trip count: shuffles below
    const int64_t v = v0 + lane;
    const bool valid = v < num_vec;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
    for (int s = 0; s < num_splits; ++s) {
      const float w = __shfl_sync(0xffffffffu, s < kWarpSize ? w0 : w1, s % kWarpSize);
      if (valid) {
        const float4 x = src[s * vec_split_stride + v];
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
      }
    }
    if (valid) {
      T* d = dst + 4 * v;
      d[0] = from_float<T>(acc.x * inv_sum);
      d[1] = from_float<T>(acc.y * inv_sum);
      d[2] = from_float<T>(acc.z * inv_sum);
      d[3] = from_float<T>(acc.w * inv_sum);
    }
  }
}

}  // namespace pyorch::kernels
