// CUDA adapters of fused_moe_decode and grouped_topk: check, guard, stream, call cuda/, check
// status.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "moe_decode_checks.h"
#include "ops.h"
#include "pyorch/launch.h"
#include "pyorch/moe_decode.h"

using pyorch::aligned16;
using pyorch::check_same_cuda;

void fused_moe_decode(at::Tensor& out, at::Tensor& act, const at::Tensor& hidden_states,
                      const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                      const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                      const at::Tensor& num_tokens_post_padded, int64_t block_size,
                      std::optional<bool> pdl) {
  const char* op = "fused_moe_decode";
  const pyorch::FusedMoeDecodeShape s = pyorch::check_fused_moe_decode(
      out, act, hidden_states, w13, w2, topk_weights, sorted_token_ids, expert_ids,
      num_tokens_post_padded, block_size);
  check_same_cuda({&hidden_states, &out, &act, &w13, &w2, &topk_weights, &sorted_token_ids,
                   &expert_ids, &num_tokens_post_padded},
                  op);
  TORCH_CHECK(hidden_states.scalar_type() != at::kFloat, op,
              ": CUDA takes float16 or bfloat16 (tensor cores), got float32");
  TORCH_CHECK(
      block_size == pyorch::kMoeDecodeBlockSmall || block_size == pyorch::kMoeDecodeBlockLarge, op,
      ": CUDA block_size must be ", pyorch::kMoeDecodeBlockSmall, " or ",
      pyorch::kMoeDecodeBlockLarge, ", got ", block_size);
  TORCH_CHECK(s.num_tokens <= pyorch::kMoeDecodeMaxTokens, op, ": CUDA takes at most ",
              pyorch::kMoeDecodeMaxTokens, " tokens, got ", s.num_tokens);
  TORCH_CHECK(s.hidden % 8 == 0 && s.inter % 8 == 0 && s.hidden_stride % 8 == 0 &&
                  aligned16(hidden_states) && aligned16(w13) && aligned16(w2) && aligned16(act),
              op, ": the hidden size (", s.hidden, "), the intermediate size (", s.inter,
              ") and hidden_states' row stride (", s.hidden_stride,
              ") must be multiples of 8, the tensors 16-byte aligned");
  const c10::cuda::OptionalCUDAGuard guard(hidden_states.device());
  PYORCH_CHECK_CUDA(pyorch::fused_moe_decode(
      out.data_ptr(), act.data_ptr(), hidden_states.const_data_ptr(), w13.const_data_ptr(),
      w2.const_data_ptr(), topk_weights.const_data_ptr<float>(),
      sorted_token_ids.const_data_ptr<int32_t>(), expert_ids.const_data_ptr<int32_t>(),
      num_tokens_post_padded.const_data_ptr<int32_t>(),
      pyorch::to_pyorch_dtype(hidden_states.scalar_type()), s.num_tokens, s.top_k, s.num_sorted,
      s.num_blocks, s.num_experts, s.hidden, s.inter, s.hidden_stride, block_size,
      pdl.value_or(pyorch::pdl_enabled()), c10::cuda::getCurrentCUDAStream()));
}

void grouped_topk(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& gating_output,
                  int64_t num_expert_group, int64_t topk_group, bool renormalize,
                  const std::string& scoring_func, double routed_scaling_factor,
                  const std::optional<at::Tensor>& e_score_correction_bias) {
  const char* op = "grouped_topk";
  const int64_t top_k = pyorch::check_grouped_topk(
      topk_weights, topk_ids, gating_output, num_expert_group, topk_group, e_score_correction_bias);
  const int scoring = pyorch::grouped_topk_scoring(scoring_func);
  check_same_cuda({&gating_output, &topk_weights, &topk_ids}, op);
  const int64_t num_experts = gating_output.size(1);
  TORCH_CHECK(num_experts <= 1024 && num_expert_group <= 32 && top_k <= 32, op,
              ": CUDA takes up to 1024 experts, 32 groups and top_k <= 32, got ", num_experts, ", ",
              num_expert_group, " and ", top_k);
  const int64_t num_tokens = gating_output.size(0);
  const c10::cuda::OptionalCUDAGuard guard(gating_output.device());
  PYORCH_CHECK_CUDA(pyorch::grouped_topk(
      topk_weights.data_ptr<float>(), topk_ids.data_ptr(),
      pyorch::to_pyorch_dtype(topk_ids.scalar_type()), gating_output.const_data_ptr(),
      pyorch::to_pyorch_dtype(gating_output.scalar_type()),
      e_score_correction_bias ? e_score_correction_bias->const_data_ptr<float>() : nullptr,
      num_tokens, num_experts, top_k, num_expert_group, topk_group,
      num_tokens <= 1 ? num_experts : gating_output.stride(0), renormalize,
      static_cast<pyorch::MoeScoring>(scoring), static_cast<float>(routed_scaling_factor),
      c10::cuda::getCurrentCUDAStream()));
}
