// Instantiates the decode MoE kernel pair and grouped_topk behind pyorch/moe_decode.h.
#include "moe/grouped_topk.cuh"
#include "moe/moe_decode.cuh"
#include "pyorch/moe_decode.h"

namespace pyorch {

cudaError_t fused_moe_decode(void* out, void* act, const void* hidden_states, const void* w13,
                             const void* w2, const float* topk_weights,
                             const int32_t* sorted_token_ids, const int32_t* expert_ids,
                             const int32_t* num_tokens_post_pad, DType dtype, int64_t num_tokens,
                             int64_t top_k, int64_t num_sorted, int64_t num_blocks,
                             int64_t num_experts, int64_t hidden, int64_t inter,
                             int64_t hidden_stride, int64_t block_size, bool pdl,
                             cudaStream_t stream) {
  if (hidden % 8 != 0 || inter % 8 != 0 || hidden_stride % 8 != 0 || top_k < 1 ||
      num_tokens > kMoeDecodeMaxTokens) {
    PYORCH_INVALID(
        "fused_moe_decode: hidden, intermediate size and row stride must be multiples of 8, "
        "top_k >= 1 and at most %d tokens",
        static_cast<int>(kMoeDecodeMaxTokens));
  }
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&]() -> cudaError_t {
    const kernels::MoeDecodeParams<T> p{static_cast<T*>(out),
                                        static_cast<T*>(act),
                                        static_cast<const T*>(hidden_states),
                                        static_cast<const T*>(w13),
                                        static_cast<const T*>(w2),
                                        topk_weights,
                                        sorted_token_ids,
                                        expert_ids,
                                        num_tokens_post_pad,
                                        num_tokens,
                                        num_tokens * top_k,
                                        num_sorted,
                                        num_blocks,
                                        num_experts,
                                        top_k,
                                        hidden,
                                        inter,
                                        hidden_stride};
    switch (block_size) {
      case kMoeDecodeBlockSmall: return kernels::launch_moe_decode<T, 1>(p, pdl, stream);
      case kMoeDecodeBlockLarge: return kernels::launch_moe_decode<T, 2>(p, pdl, stream);
      default:
        PYORCH_INVALID("fused_moe_decode: unsupported block_size %lld (8 or 16)",
                       static_cast<long long>(block_size));
    }
  });
}

cudaError_t grouped_topk(float* topk_weights, void* topk_ids, DType ids_dtype, const void* gating,
                         DType gating_dtype, const float* bias, int64_t num_tokens,
                         int64_t num_experts, int64_t top_k, int64_t num_groups, int64_t topk_group,
                         int64_t gating_stride, bool renormalize, MoeScoring scoring,
                         float routed_scaling_factor, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kernels::kGroupedTopkMaxExperts || num_groups < 1 ||
      num_groups > 32 || num_experts % num_groups != 0 || topk_group < 1 ||
      topk_group > num_groups || top_k < 1 || top_k > 32 ||
      top_k > topk_group * (num_experts / num_groups)) {
    PYORCH_INVALID(
        "grouped_topk: need E <= %d divisible by num_expert_group <= 32, 1 <= topk_group <= "
        "num_expert_group and 1 <= top_k <= min(32, topk_group * E / num_expert_group)",
        kernels::kGroupedTopkMaxExperts);
  }
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((num_tokens + kernels::kGroupedTopkWarps - 1) /
                                        kernels::kGroupedTopkWarps));
  const int threads = kernels::kGroupedTopkWarps * kernels::kWarpSize;
  return PYORCH_DISPATCH_FLOAT_TYPES(gating_dtype, T, [&]() -> cudaError_t {
    const T* g = static_cast<const T*>(gating);
    const int m = static_cast<int>(num_tokens), e = static_cast<int>(num_experts);
    const int k = static_cast<int>(top_k), ng = static_cast<int>(num_groups);
    const int tg = static_cast<int>(topk_group);
    if (ids_dtype == DType::kInt32) {
      kernels::grouped_topk_kernel<T, int32_t><<<grid, threads, 0, stream>>>(
          topk_weights, static_cast<int32_t*>(topk_ids), g, bias, m, e, k, ng, tg, gating_stride,
          renormalize, scoring, routed_scaling_factor);
    } else if (ids_dtype == DType::kInt64) {
      kernels::grouped_topk_kernel<T, int64_t><<<grid, threads, 0, stream>>>(
          topk_weights, static_cast<int64_t*>(topk_ids), g, bias, m, e, k, ng, tg, gating_stride,
          renormalize, scoring, routed_scaling_factor);
    } else {
      PYORCH_INVALID("grouped_topk: topk_ids must be int32 or int64");
    }
    return cudaGetLastError();
  });
}

}  // namespace pyorch
