// CUDA adapters of the mixture-of-experts ops: check, guard, stream, call cuda/, check status.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "moe_checks.h"
#include "ops.h"
#include "pyorch/moe.h"

using pyorch::aligned16;
using pyorch::check_same_cuda;

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize) {
  const int64_t top_k =
      pyorch::check_topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output);
  check_same_cuda({&gating_output, &topk_weights, &topk_indices, &token_expert_indices},
                  "topk_softmax");
  const int64_t num_experts = gating_output.size(1);
  TORCH_CHECK(num_experts <= pyorch::kMoeMaxExperts && top_k <= 32,
              "topk_softmax: CUDA takes up to ", pyorch::kMoeMaxExperts,
              " experts and top_k <= 32, got ", num_experts, " and ", top_k);
  const int64_t num_tokens = gating_output.size(0);
  const c10::cuda::OptionalCUDAGuard guard(gating_output.device());
  PYORCH_CHECK_CUDA(pyorch::topk_softmax(
      topk_weights.data_ptr<float>(), topk_indices.data_ptr(),
      pyorch::to_pyorch_dtype(topk_indices.scalar_type()), token_expert_indices.data_ptr<int32_t>(),
      gating_output.const_data_ptr(), pyorch::to_pyorch_dtype(gating_output.scalar_type()),
      num_tokens, num_experts, top_k, num_tokens <= 1 ? num_experts : gating_output.stride(0),
      renormalize, c10::cuda::getCurrentCUDAStream()));
}

void moe_sum(const at::Tensor& input, at::Tensor& output) {
  pyorch::check_moe_sum(input, output);
  check_same_cuda({&input, &output}, "moe_sum");
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::moe_sum(
      output.data_ptr(), input.const_data_ptr(), pyorch::to_pyorch_dtype(input.scalar_type()),
      input.size(0), input.size(1), input.size(2), c10::cuda::getCurrentCUDAStream()));
}

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& experts_ids,
                          at::Tensor& num_tokens_post_pad,
                          const std::optional<at::Tensor>& expert_map) {
  pyorch::check_moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids,
                                     experts_ids, num_tokens_post_pad, expert_map);
  check_same_cuda({&topk_ids, &sorted_token_ids, &experts_ids, &num_tokens_post_pad},
                  "moe_align_block_size");
  if (expert_map) check_same_cuda({&topk_ids, &*expert_map}, "moe_align_block_size");
  TORCH_CHECK(num_experts <= pyorch::kMoeMaxExperts, "moe_align_block_size: CUDA takes up to ",
              pyorch::kMoeMaxExperts, " experts, got ", num_experts);
  const c10::cuda::OptionalCUDAGuard guard(topk_ids.device());
  PYORCH_CHECK_CUDA(pyorch::moe_align_block_size(
      topk_ids.const_data_ptr(), pyorch::to_pyorch_dtype(topk_ids.scalar_type()), topk_ids.numel(),
      num_experts, block_size, sorted_token_ids.data_ptr<int32_t>(), sorted_token_ids.numel(),
      experts_ids.data_ptr<int32_t>(), experts_ids.numel(), num_tokens_post_pad.data_ptr<int32_t>(),
      expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr,
      c10::cuda::getCurrentCUDAStream()));
}

void fused_moe_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& topk_weights,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_size,
                    bool silu_and_mul) {
  const pyorch::FusedMoeGemmShape s =
      pyorch::check_fused_moe_gemm(out, input, weight, topk_weights, sorted_token_ids, expert_ids,
                                   num_tokens_post_padded, top_k, block_size, silu_and_mul);
  check_same_cuda({&out, &input, &weight, &sorted_token_ids, &expert_ids, &num_tokens_post_padded},
                  "fused_moe_gemm");
  if (topk_weights) check_same_cuda({&out, &*topk_weights}, "fused_moe_gemm");
  const char* op = "fused_moe_gemm";
  TORCH_CHECK(input.scalar_type() != at::kFloat, op,
              ": CUDA takes float16 or bfloat16 (tensor cores), got float32");
  TORCH_CHECK(block_size == pyorch::kMoeBlockSizeSmall || block_size == pyorch::kMoeBlockSizeLarge,
              op, ": CUDA block_size must be ", pyorch::kMoeBlockSizeSmall, " or ",
              pyorch::kMoeBlockSizeLarge, ", got ", block_size);
  TORCH_CHECK(s.k % 8 == 0 && s.input_stride % 8 == 0 && aligned16(input) && aligned16(weight), op,
              ": K (", s.k, ") and input's row stride (", s.input_stride,
              ") must be multiples of 8, input and weight 16-byte aligned");
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::fused_moe_gemm(
      out.data_ptr(), input.const_data_ptr(), weight.const_data_ptr(),
      topk_weights ? topk_weights->const_data_ptr<float>() : nullptr,
      sorted_token_ids.const_data_ptr<int32_t>(), expert_ids.const_data_ptr<int32_t>(),
      num_tokens_post_padded.const_data_ptr<int32_t>(),
      pyorch::to_pyorch_dtype(input.scalar_type()), s.num_flat, s.num_sorted, s.num_experts, s.n,
      s.k, s.input_stride, top_k, block_size, silu_and_mul, c10::cuda::getCurrentCUDAStream()));
}
