// CPU kernels of fused_moe_decode (the decode MoE pair: gate_up with SiLU-and-mul, down with the
// routing weights and the top-k sum) and grouped_topk. Same contracts and rounding points as the
// CUDA kernels (cuda/include/pyorch/moe_decode.h): gate and up are rounded to the dtype before
// SiLU-and-mul, act is stored in the dtype, the down products and the sum over top_k stay in fp32
// and out is rounded once.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "moe_decode_checks.h"
#include "ops.h"

namespace pyorch::cpu {

void fused_moe_decode(at::Tensor& out, at::Tensor& act, const at::Tensor& hidden_states,
                      const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                      const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                      const at::Tensor& num_tokens_post_padded, int64_t block_size,
                      std::optional<bool> pdl) {
  (void)pdl;  // a CUDA launch option; the CPU kernel has nothing to overlap
  const FusedMoeDecodeShape s =
      check_fused_moe_decode(out, act, hidden_states, w13, w2, topk_weights, sorted_token_ids,
                             expert_ids, num_tokens_post_padded, block_size);
  const at::ScalarType dtype = hidden_states.scalar_type();
  at::Tensor acc = at::zeros({s.num_tokens, s.hidden}, hidden_states.options().dtype(at::kFloat));
  const int64_t num_flat = s.num_tokens * s.top_k;
  const int64_t used =
      std::min<int64_t>(num_tokens_post_padded.const_data_ptr<int32_t>()[0], s.num_sorted);
  const int32_t* sorted = sorted_token_ids.const_data_ptr<int32_t>();
  const int32_t* experts = expert_ids.const_data_ptr<int32_t>();
  const at::Tensor weights = topk_weights.reshape({-1});
  for (int64_t b = 0; b * block_size < used && b < s.num_blocks; ++b) {
    const int32_t e = experts[b];
    if (e < 0 || e >= s.num_experts) continue;  // another rank's expert
    std::vector<int64_t> pairs;
    for (int64_t i = b * block_size; i < std::min(used, (b + 1) * block_size); ++i) {
      if (sorted[i] >= 0 && sorted[i] < num_flat) pairs.push_back(sorted[i]);
    }
    if (pairs.empty()) continue;
    const at::Tensor f = at::tensor(pairs, at::kLong);
    const at::Tensor tokens = at::floor_divide(f, s.top_k);
    const at::Tensor x = hidden_states.index_select(0, tokens).to(at::kFloat);
    const at::Tensor gu = at::matmul(x, w13[e].to(at::kFloat).t()).to(dtype).to(at::kFloat);
    const at::Tensor a =
        (at::silu(gu.narrow(1, 0, s.inter)) * gu.narrow(1, s.inter, s.inter)).to(dtype);
    act.index_copy_(0, f, a);
    const at::Tensor y = at::matmul(a.to(at::kFloat), w2[e].to(at::kFloat).t()) *
                         weights.index_select(0, f).unsqueeze(1);
    acc.index_add_(0, tokens, y);
  }
  out.copy_(acc);
}

namespace {

template <typename IndexT>
void grouped_topk_row(const float* logits, float* weights, IndexT* ids, const float* bias,
                      int64_t num_experts, int64_t top_k, int64_t num_groups, int64_t topk_group,
                      bool renormalize, bool sigmoid, float routed_scaling_factor,
                      std::vector<float>& scores, std::vector<float>& choice,
                      std::vector<char>& kept, std::vector<char>& taken) {
  if (sigmoid) {
    for (int64_t e = 0; e < num_experts; ++e) scores[e] = 1.f / (1.f + std::exp(-logits[e]));
  } else {
    const float mx = *std::max_element(logits, logits + num_experts);
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) sum += scores[e] = std::exp(logits[e] - mx);
    for (int64_t e = 0; e < num_experts; ++e) scores[e] /= sum;
  }
  for (int64_t e = 0; e < num_experts; ++e) choice[e] = bias ? scores[e] + bias[e] : scores[e];
  const int64_t group_size = num_experts / num_groups;
  std::vector<float> group_score(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    float first = -INFINITY, second = -INFINITY;
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
      if (choice[e] > first) {
        second = first;
        first = choice[e];
      } else if (choice[e] > second) {
        second = choice[e];
      }
    }
    group_score[g] = bias ? first + second : first;
  }
  std::fill(kept.begin(), kept.end(), 0);
  for (int64_t r = 0; r < topk_group; ++r) {  // the best groups, ties to the lower index
    int64_t best = -1;
    for (int64_t g = 0; g < num_groups; ++g) {
      if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
    }
    kept[best] = 1;
  }
  std::fill(taken.begin(), taken.end(), 0);
  float selected = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {  // the best experts of the kept groups
    int64_t best = -1;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!taken[e] && kept[e / group_size] && (best < 0 || choice[e] > choice[best])) best = e;
    }
    taken[best] = 1;
    ids[j] = static_cast<IndexT>(best);
    weights[j] = scores[best];
    selected += scores[best];
  }
  for (int64_t j = 0; j < top_k; ++j) {
    const float w = renormalize && selected > 0.f ? weights[j] / selected : weights[j];
    weights[j] = w * routed_scaling_factor;
  }
}

}  // namespace

void grouped_topk(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& gating_output,
                  int64_t num_expert_group, int64_t topk_group, bool renormalize,
                  const std::string& scoring_func, double routed_scaling_factor,
                  const std::optional<at::Tensor>& e_score_correction_bias) {
  const int64_t top_k = check_grouped_topk(topk_weights, topk_ids, gating_output, num_expert_group,
                                           topk_group, e_score_correction_bias);
  const bool sigmoid = grouped_topk_scoring(scoring_func) == 1;
  const int64_t num_tokens = gating_output.size(0), num_experts = gating_output.size(1);
  if (num_tokens == 0) return;
  const at::Tensor logits = gating_output.to(at::kFloat).contiguous();
  const float* bias =
      e_score_correction_bias ? e_score_correction_bias->const_data_ptr<float>() : nullptr;
  const float* lg = logits.const_data_ptr<float>();
  float* w = topk_weights.data_ptr<float>();
  const bool ids32 = topk_ids.scalar_type() == at::kInt;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(num_experts), choice(num_experts);
    std::vector<char> kept(num_expert_group), taken(num_experts);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t o = row * top_k;
      if (ids32) {
        grouped_topk_row(lg + row * num_experts, w + o, topk_ids.data_ptr<int32_t>() + o, bias,
                         num_experts, top_k, num_expert_group, topk_group, renormalize, sigmoid,
                         static_cast<float>(routed_scaling_factor), scores, choice, kept, taken);
      } else {
        grouped_topk_row(lg + row * num_experts, w + o, topk_ids.data_ptr<int64_t>() + o, bias,
                         num_experts, top_k, num_expert_group, topk_group, renormalize, sigmoid,
                         static_cast<float>(routed_scaling_factor), scores, choice, kept, taken);
      }
    }
  });
}

}  // namespace pyorch::cpu
