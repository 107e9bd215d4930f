// Instantiates the MoE kernels behind the torch-free C API (pyorch/moe.h).
#include <type_traits>

#include "moe/fused_moe_gemm.cuh"
#include "moe/moe_routing.cuh"
#include "pyorch/moe.h"

namespace pyorch {

cudaError_t topk_softmax(float* topk_weights, void* topk_indices, DType indices_dtype,
                         int32_t* token_expert_indices, const void* gating, DType gating_dtype,
                         int64_t num_tokens, int64_t num_experts, int64_t top_k,
                         int64_t gating_stride, bool renormalize, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeMaxExperts || top_k < 1 || top_k > 32 ||
      top_k > num_experts) {
    PYORCH_INVALID("topk_softmax: need 1 <= top_k <= min(32, num_experts) and num_experts <= %d",
                   static_cast<int>(kMoeMaxExperts));
  }
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(
      static_cast<unsigned>((num_tokens + kernels::kTopkWarps - 1) / kernels::kTopkWarps));
  const int threads = kernels::kTopkWarps * kernels::kWarpSize;
  return PYORCH_DISPATCH_FLOAT_TYPES(gating_dtype, T, [&]() -> cudaError_t {
    const T* g = static_cast<const T*>(gating);
    const int m = static_cast<int>(num_tokens), e = static_cast<int>(num_experts);
    const int k = static_cast<int>(top_k);
    if (indices_dtype != DType::kInt32 && indices_dtype != DType::kInt64) {
      PYORCH_INVALID("topk_softmax: topk_indices must be int32 or int64");
    }
    // Experts per lane: the smallest power of two covering E / 32.
    // With PDL: at decode this kernel sits between the router GEMM and the expert kernels, a
    // few microseconds of launch latency that can hide behind the router's tail.
    const bool pdl = pdl_enabled();
    cudaError_t status = cudaSuccess;
    auto launch = [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      if (indices_dtype == DType::kInt32) {
        status = kernels::launch_kernel(&kernels::topk_softmax_kernel<T, int32_t, kPerLane>, grid,
                                        dim3(threads), 0, stream, pdl, topk_weights,
                                        static_cast<int32_t*>(topk_indices), token_expert_indices,
                                        g, m, e, k, gating_stride, renormalize);
      } else {
        status = kernels::launch_kernel(&kernels::topk_softmax_kernel<T, int64_t, kPerLane>, grid,
                                        dim3(threads), 0, stream, pdl, topk_weights,
                                        static_cast<int64_t*>(topk_indices), token_expert_indices,
                                        g, m, e, k, gating_stride, renormalize);
      }
    };
    if (e <= 32) {
      launch(std::integral_constant<int, 1>{});
    } else if (e <= 64) {
      launch(std::integral_constant<int, 2>{});
    } else if (e <= 128) {
      launch(std::integral_constant<int, 4>{});
    } else if (e <= 256) {
      launch(std::integral_constant<int, 8>{});
    } else if (e <= 512) {
      launch(std::integral_constant<int, 16>{});
    } else {
      launch(std::integral_constant<int, 32>{});
    }
    return status;
  });
}

cudaError_t moe_align_block_size(const void* topk_ids, DType ids_dtype, int64_t num_flat,
                                 int64_t num_experts, int64_t block_size, int32_t* sorted_token_ids,
                                 int64_t num_sorted, int32_t* expert_ids, int64_t num_blocks,
                                 int32_t* num_tokens_post_pad, const int32_t* expert_map,
                                 cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeMaxExperts || block_size < 1) {
    PYORCH_INVALID("moe_align_block_size: need 1 <= num_experts <= %d and block_size >= 1",
                   static_cast<int>(kMoeMaxExperts));
  }
  const size_t smem = sizeof(int32_t) * (2 * num_experts + 1);
  const int f = static_cast<int>(num_flat), e = static_cast<int>(num_experts);
  const int bs = static_cast<int>(block_size), ns = static_cast<int>(num_sorted);
  const int nb = static_cast<int>(num_blocks);
  if (ids_dtype == DType::kInt32) {
    kernels::moe_align_block_size_kernel<int32_t><<<1, kernels::kAlignThreads, smem, stream>>>(
        static_cast<const int32_t*>(topk_ids), sorted_token_ids, expert_ids, num_tokens_post_pad,
        expert_map, f, e, bs, ns, nb);
  } else if (ids_dtype == DType::kInt64) {
    kernels::moe_align_block_size_kernel<int64_t><<<1, kernels::kAlignThreads, smem, stream>>>(
        static_cast<const int64_t*>(topk_ids), sorted_token_ids, expert_ids, num_tokens_post_pad,
        expert_map, f, e, bs, ns, nb);
  } else {
    PYORCH_INVALID("moe_align_block_size: topk_ids must be int32 or int64");
  }
  return cudaGetLastError();
}

cudaError_t fused_moe_gemm(void* out, const void* input, const void* weight,
                           const float* topk_weights, const int32_t* sorted_token_ids,
                           const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                           DType dtype, int64_t num_flat, int64_t num_sorted, int64_t num_experts,
                           int64_t n, int64_t k, int64_t input_stride, int64_t top_k,
                           int64_t block_size, bool silu_and_mul, cudaStream_t stream) {
  if (k % 8 != 0 || input_stride % 8 != 0 || (silu_and_mul && n % 2 != 0) || top_k < 1) {
    PYORCH_INVALID("fused_moe_gemm: K and the input row stride must be multiples of 8");
  }
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&]() -> cudaError_t {
    kernels::MoeGemmParams<T> p{static_cast<T*>(out),
                                static_cast<const T*>(input),
                                static_cast<const T*>(weight),
                                topk_weights,
                                sorted_token_ids,
                                expert_ids,
                                num_tokens_post_padded,
                                num_flat,
                                num_sorted,
                                num_experts,
                                n,
                                k,
                                input_stride,
                                top_k,
                                silu_and_mul ? n / 2 : n};
    switch (block_size) {
      case kMoeBlockSizeSmall:
        return silu_and_mul ? kernels::launch_fused_moe_gemm<T, 16, true>(p, stream)
                            : kernels::launch_fused_moe_gemm<T, 16, false>(p, stream);
      case kMoeBlockSizeLarge:
        return silu_and_mul ? kernels::launch_fused_moe_gemm<T, 64, true>(p, stream)
                            : kernels::launch_fused_moe_gemm<T, 64, false>(p, stream);
      default:
        PYORCH_INVALID("fused_moe_gemm: unsupported block_size %lld (16 or 64)",
                       static_cast<long long>(block_size));
    }
  });
}

cudaError_t moe_sum(void* output, const void* input, DType dtype, int64_t num_tokens, int64_t top_k,
                    int64_t hidden_size, cudaStream_t stream) {
  if (num_tokens == 0 || hidden_size == 0) return cudaSuccess;
  const dim3 grid(
      static_cast<unsigned>(num_tokens),
      static_cast<unsigned>((hidden_size + kernels::kMoeSumThreads - 1) / kernels::kMoeSumThreads));
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    kernels::moe_sum_kernel<T><<<grid, kernels::kMoeSumThreads, 0, stream>>>(
        static_cast<T*>(output), static_cast<const T*>(input), static_cast<int>(top_k),
        static_cast<int>(hidden_size));
    return cudaGetLastError();
  });
}

}  // namespace pyorch
