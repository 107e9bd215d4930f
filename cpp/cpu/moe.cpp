// CPU kernels of the mixture-of-experts ops: routing (topk_softmax), the token sort by expert
// (moe_align_block_size), the grouped expert GEMM (fused_moe_gemm) and the top-k reduction
// (moe_sum). Same contracts as the CUDA kernels (cuda/include/pyorch/moe.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "moe_checks.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

template <typename IndexT>
void topk_softmax_rows(float* weights, IndexT* indices, int32_t* token_expert, const float* probs,
                       int64_t row, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                       bool renormalize, std::vector<char>& taken) {
  std::fill(taken.begin(), taken.end(), 0);
  float selected_sum = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    // The largest untaken probability; ties go to the lower expert id.
    int64_t best = -1;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
    }
    taken[best] = 1;
    weights[j] = probs[best];
    indices[j] = static_cast<IndexT>(best);
    token_expert[j] = static_cast<int32_t>(j * num_tokens + row);
    selected_sum += probs[best];
  }
  if (renormalize && selected_sum > 0.f) {
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= selected_sum;
  }
}

}  // namespace

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize) {
  const int64_t top_k =
      check_topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output);
  const int64_t num_tokens = gating_output.size(0);
  const int64_t num_experts = gating_output.size(1);
  if (num_tokens == 0) return;
  const int64_t g_stride = num_tokens <= 1 ? num_experts : gating_output.stride(0);
  PYORCH_CPU_DISPATCH_FLOATS(gating_output.scalar_type(), "topk_softmax", [&] {
    const scalar_t* g = gating_output.const_data_ptr<scalar_t>();
    float* w = topk_weights.data_ptr<float>();
    int32_t* te = token_expert_indices.data_ptr<int32_t>();
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> probs(num_experts);
      std::vector<char> taken(num_experts);
      for (int64_t row = begin; row < end; ++row) {
        to_float(g + row * g_stride, probs.data(), num_experts);
        float max_logit = probs[0];
        for (int64_t e = 1; e < num_experts; ++e) max_logit = std::max(max_logit, probs[e]);
        float sum = 0.f;
        for (int64_t e = 0; e < num_experts; ++e) {
          probs[e] = std::exp(probs[e] - max_logit);
          sum += probs[e];
        }
        for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
        const int64_t o = row * top_k;
        if (topk_indices.scalar_type() == at::kInt) {
          topk_softmax_rows(w + o, topk_indices.data_ptr<int32_t>() + o, te + o, probs.data(), row,
                            num_tokens, num_experts, top_k, renormalize, taken);
        } else {
          topk_softmax_rows(w + o, topk_indices.data_ptr<int64_t>() + o, te + o, probs.data(), row,
                            num_tokens, num_experts, top_k, renormalize, taken);
        }
      }
    });
  });
}

void moe_sum(const at::Tensor& input, at::Tensor& output) {
  check_moe_sum(input, output);
  TORCH_CHECK(input.device().is_cpu() && output.device().is_cpu(), "moe_sum: tensors on CPU");
  // fp32 sum over top_k, rounded once (as the CUDA kernel does).
  output.copy_(input.to(at::kFloat).sum(1));
}

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& experts_ids,
                          at::Tensor& num_tokens_post_pad,
                          const std::optional<at::Tensor>& expert_map) {
  check_moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                             num_tokens_post_pad, expert_map);
  const at::Tensor ids = topk_ids.to(at::kLong);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t num_flat = ids.numel();
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t f = 0; f < num_flat; ++f) {
    TORCH_CHECK(id[f] >= 0 && id[f] < num_experts, "moe_align_block_size: expert id ", id[f],
                " out of range [0, ", num_experts, ")");
    ++counts[id[f]];
  }
  // Each expert's rows start at a multiple of block_size; pad entries hold num_flat.
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) {
    starts[e + 1] = starts[e] + (counts[e] + block_size - 1) / block_size * block_size;
  }
  int32_t* sorted = sorted_token_ids.data_ptr<int32_t>();
  int32_t* blocks = experts_ids.data_ptr<int32_t>();
  std::fill(sorted, sorted + sorted_token_ids.numel(), static_cast<int32_t>(num_flat));
  std::fill(blocks, blocks + experts_ids.numel(), -1);
  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t b = starts[e] / block_size; b < starts[e + 1] / block_size; ++b) {
      blocks[b] = map ? map[e] : static_cast<int32_t>(e);
    }
  }
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t f = 0; f < num_flat; ++f) sorted[fill[id[f]]++] = static_cast<int32_t>(f);
  num_tokens_post_pad.data_ptr<int32_t>()[0] = static_cast<int32_t>(starts[num_experts]);
}

void fused_moe_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& topk_weights,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_size,
                    bool silu_and_mul) {
  const FusedMoeGemmShape s =
      check_fused_moe_gemm(out, input, weight, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, top_k, block_size, silu_and_mul);
  const int64_t num_padded =
      std::min<int64_t>(num_tokens_post_padded.item<int32_t>(), s.num_blocks * block_size);
  const int32_t* sorted = sorted_token_ids.const_data_ptr<int32_t>();
  const int32_t* experts = expert_ids.const_data_ptr<int32_t>();
  // Zero first: rows of non-local experts (expert id -1) contribute nothing to moe_sum.
  out.zero_();
  // One GEMM per run of blocks of the same expert (moe_align_block_size makes each expert's
  // blocks contiguous), computed in fp32 and rounded once.
  int64_t b = 0;
  const int64_t num_blocks_used = (num_padded + block_size - 1) / block_size;
  while (b < num_blocks_used) {
    const int32_t e = experts[b];
    int64_t b_end = b + 1;
    while (b_end < num_blocks_used && experts[b_end] == e) ++b_end;
    std::vector<int64_t> rows;
    if (e >= 0) {
      TORCH_CHECK(e < s.num_experts, "fused_moe_gemm: expert id ", e, " out of range [0, ",
                  s.num_experts, ")");
      for (int64_t i = b * block_size; i < std::min(b_end * block_size, num_padded); ++i) {
        if (sorted[i] >= 0 && sorted[i] < s.num_flat) rows.push_back(sorted[i]);
      }
    }
    b = b_end;
    if (rows.empty()) continue;
    const at::Tensor flat = at::tensor(rows, at::TensorOptions().dtype(at::kLong));
    const at::Tensor a = input.index_select(0, at::floor_divide(flat, top_k)).to(at::kFloat);
    at::Tensor c = at::mm(a, weight[e].to(at::kFloat).t());  // [rows, N]
    if (silu_and_mul)
      c = at::silu(c.narrow(1, 0, s.out_cols)) * c.narrow(1, s.out_cols, s.out_cols);
    if (topk_weights) c = c * topk_weights->index_select(0, flat).unsqueeze(1);
    out.index_copy_(0, flat, c.to(out.scalar_type()));
  }
}

}  // namespace pyorch::cpu
