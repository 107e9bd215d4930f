// Mixture-of-experts ops: routing, the token sort by expert, the grouped expert GEMM and the
// top-k reduction (vLLM's topk_softmax, moe_align_block_size, fused_moe, moe_sum).
// M tokens, E experts, top_k experts per token, num_flat = M * top_k (token, expert) pairs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// The most experts topk_softmax and moe_align_block_size take (a lane's taken-mask is 32 bits).
constexpr int64_t kMoeMaxExperts = 1024;
// The row tiles (block_size) fused_moe_gemm is built for.
constexpr int64_t kMoeBlockSizeSmall = 16;
constexpr int64_t kMoeBlockSizeLarge = 64;

// softmax(gating[m, :]) in fp32, its top_k largest (ties to the lower id), renormalized to sum
// to 1 when renormalize.
//   topk_weights: [M, top_k] fp32; topk_indices: [M, top_k] int32 or int64 (indices_dtype);
//   token_expert_indices: [M, top_k] int32 = j * M + m; gating: [M, E] (row stride
//   gating_stride), fp32/fp16/bf16.
cudaError_t topk_softmax(float* topk_weights, void* topk_indices, DType indices_dtype,
                         int32_t* token_expert_indices, const void* gating, DType gating_dtype,
                         int64_t num_tokens, int64_t num_experts, int64_t top_k,
                         int64_t gating_stride, bool renormalize, cudaStream_t stream);

// Sorts the flat pair ids f of topk_ids [num_flat] (int32 or int64) by expert, each expert's
// run padded to a multiple of block_size with the value num_flat (ids outside [0, E) are
// dropped). sorted_token_ids: [num_sorted] int32; expert_ids: [num_blocks] int32 (through
// expert_map [E] when not null; -1 past the end); num_tokens_post_pad: [1] int32. One CTA.
cudaError_t moe_align_block_size(const void* topk_ids, DType ids_dtype, int64_t num_flat,
                                 int64_t num_experts, int64_t block_size, int32_t* sorted_token_ids,
                                 int64_t num_sorted, int32_t* expert_ids, int64_t num_blocks,
                                 int32_t* num_tokens_post_pad, const int32_t* expert_map,
                                 cudaStream_t stream);

// The grouped expert GEMM, one launch. For every entry i < *num_tokens_post_padded of
// sorted_token_ids whose f = sorted_token_ids[i] < num_flat, with e = expert_ids[i / block_size]: c
// = input[f / top_k, :] @ weight[e]^T; out[f, :] = c (or silu(c[:N/2]) * c[N/2:] when
// silu_and_mul), times topk_weights[f] when not null; e = -1 writes zeros.
//   out: [num_flat, out_cols] contiguous; input: [*, K] (row stride input_stride, multiple of 8);
//   weight: [E, N, K] contiguous; K % 8 == 0; input and weight 16-byte aligned; fp16/bf16;
//   block_size kMoeBlockSizeSmall or kMoeBlockSizeLarge.
cudaError_t fused_moe_gemm(void* out, const void* input, const void* weight,
                           const float* topk_weights, const int32_t* sorted_token_ids,
                           const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                           DType dtype, int64_t num_flat, int64_t num_sorted, int64_t num_experts,
                           int64_t n, int64_t k, int64_t input_stride, int64_t top_k,
                           int64_t block_size, bool silu_and_mul, cudaStream_t stream);

// output[m, :] = sum_j input[m, j, :] in fp32, rounded once. input: [M, top_k, H], output:
// [M, H], contiguous, fp32/fp16/bf16.
cudaError_t moe_sum(void* output, const void* input, DType dtype, int64_t num_tokens, int64_t top_k,
                    int64_t hidden_size, cudaStream_t stream);

}  // namespace pyorch
