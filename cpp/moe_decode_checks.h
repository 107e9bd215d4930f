// Argument checks shared by the CPU kernels (cpp/cpu/moe_decode.cpp) and the CUDA adapters
// (cpp/ops/moe_decode.cpp) of fused_moe_decode and grouped_topk, so both backends accept the same
// inputs. M tokens, E experts, top_k experts per token, H hidden, I intermediate size.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "moe_checks.h"

namespace pyorch {

struct FusedMoeDecodeShape {
  int64_t num_tokens, top_k, num_experts, hidden, inter, hidden_stride, num_sorted, num_blocks;
};

// fused_moe_decode: out [M, H] and act [M * top_k, I] contiguous; hidden_states [M, H] (last dim
// contiguous); w13 [E, 2I, H] and w2 [E, H, I] contiguous; topk_weights [M, top_k] fp32
// contiguous; sorted_token_ids / expert_ids / num_tokens_post_padded as moe_align_block_size
// writes them for block_size.
inline FusedMoeDecodeShape check_fused_moe_decode(
    const at::Tensor& out, const at::Tensor& act, const at::Tensor& hidden, const at::Tensor& w13,
    const at::Tensor& w2, const at::Tensor& topk_weights, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, int64_t block_size) {
  const char* op = "fused_moe_decode";
  const at::ScalarType t = hidden.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", t);
  for (const at::Tensor* x : {&out, &act, &w13, &w2}) {
    TORCH_CHECK(x->scalar_type() == t, op,
                ": out, act, w13 and w2 dtypes must match "
                "hidden_states' ",
                t);
  }
  TORCH_CHECK(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && out.dim() == 2 &&
                  act.dim() == 2 && topk_weights.dim() == 2,
              op,
              ": hidden_states [M, H], w13 [E, 2I, H], w2 [E, H, I], out [M, H], act "
              "[M * top_k, I] and topk_weights [M, top_k] expected");
  const int64_t m = hidden.size(0), h = hidden.size(1), e = w13.size(0);
  const int64_t inter = w2.size(2), top_k = topk_weights.size(1);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == h && w2.size(0) == e && w2.size(1) == h,
              op, ": w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit hidden size ", h,
              " and intermediate size ", inter);
  TORCH_CHECK(out.size(0) == m && out.size(1) == h, op, ": out must be [", m, ", ", h, "], got ",
              out.sizes());
  TORCH_CHECK(topk_weights.size(0) == m && top_k >= 1 && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              op, ": topk_weights must be contiguous float32 [", m, ", top_k >= 1], got ",
              topk_weights.sizes(), " ", topk_weights.scalar_type());
  TORCH_CHECK(act.size(0) == m * top_k && act.size(1) == inter, op, ": act must be [", m * top_k,
              ", ", inter, "], got ", act.sizes());
  TORCH_CHECK(
      out.is_contiguous() && act.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(), op,
      ": out, act, w13 and w2 must be contiguous");
  TORCH_CHECK(h <= 1 || hidden.stride(1) == 1, op,
              ": hidden_states' last dimension must be contiguous");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  check_moe_routing_buffers(op, sorted_token_ids, expert_ids, num_tokens_post_padded, block_size);
  const int64_t stride = m <= 1 ? h : hidden.stride(0);
  return {m, top_k, e, h, inter, stride, sorted_token_ids.numel(), expert_ids.numel()};
}

// grouped_topk's scoring_func: 0 softmax, 1 sigmoid (pyorch::MoeScoring).
inline int grouped_topk_scoring(const std::string& scoring_func) {
  if (scoring_func == "softmax") return 0;
  if (scoring_func == "sigmoid") return 1;
  TORCH_CHECK(false, "grouped_topk: scoring_func must be 'softmax' or 'sigmoid', got '",
              scoring_func, "'");
}

// grouped_topk: gating_output [M, E] fp32/fp16/bf16 (last dim contiguous); topk_weights [M, top_k]
// fp32 and topk_ids [M, top_k] int32/int64, contiguous; bias [E] fp32 contiguous or None.
// E % num_expert_group == 0, 1 <= topk_group <= num_expert_group, top_k <= topk_group * E /
// num_expert_group. Returns top_k.
inline int64_t check_grouped_topk(const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                  const at::Tensor& gating, int64_t num_expert_group,
                                  int64_t topk_group, const std::optional<at::Tensor>& bias) {
  const char* op = "grouped_topk";
  const at::ScalarType g = gating.scalar_type();
  TORCH_CHECK(g == at::kFloat || g == at::kHalf || g == at::kBFloat16, op,
              ": gating_output must be float32, float16 or bfloat16, got ", g);
  TORCH_CHECK(gating.dim() == 2 && topk_weights.dim() == 2 && topk_ids.dim() == 2, op,
              ": gating_output [num_tokens, num_experts] and the outputs [num_tokens, top_k] must "
              "be 2-D");
  const int64_t m = gating.size(0), e = gating.size(1), k = topk_weights.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.size(0) == m, op,
              ": topk_weights ", topk_weights.sizes(), " and topk_ids ", topk_ids.sizes(),
              " must both be [num_tokens=", m, ", top_k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous(), op,
              ": topk_weights must be contiguous float32");
  TORCH_CHECK(moe_index_dtype(topk_ids.scalar_type()) && topk_ids.is_contiguous(), op,
              ": topk_ids must be contiguous int32 or int64");
  TORCH_CHECK(e <= 1 || gating.stride(1) == 1, op,
              ": gating_output's last dimension must be contiguous");
  TORCH_CHECK(num_expert_group >= 1 && e % num_expert_group == 0, op,
              ": num_expert_group=", num_expert_group, " must divide the number of experts ", e);
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_expert_group, op, ": topk_group=", topk_group,
              " must be in [1, num_expert_group=", num_expert_group, "]");
  TORCH_CHECK(k >= 1 && k <= topk_group * (e / num_expert_group), op, ": top_k=", k,
              " must be in [1, topk_group * experts per group = ",
              topk_group * (e / num_expert_group), "]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == e &&
                    bias->is_contiguous() && bias->device() == gating.device(),
                op, ": e_score_correction_bias must be contiguous float32 [num_experts=", e,
                "] on gating_output's device");
  }
  return k;
}

}  // namespace pyorch
