// Argument checks shared by the CPU kernels (cpp/cpu/moe.cpp) and the CUDA adapters
// (cpp/ops/moe.cpp) of the mixture-of-experts ops, so both backends accept the same inputs.
// Shapes: M tokens, E experts, top_k experts per token, H hidden size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

inline bool moe_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

// topk_softmax: gating_output [M, E] (fp32/fp16/bf16, rows may be strided); topk_weights [M,
// top_k] fp32; topk_indices [M, top_k] int32 or int64; token_expert_indices [M, top_k] int32.
// All outputs contiguous. Returns top_k.
inline int64_t check_topk_softmax(const at::Tensor& topk_weights, const at::Tensor& topk_indices,
                                  const at::Tensor& token_expert_indices,
                                  const at::Tensor& gating_output) {
  const at::ScalarType g = gating_output.scalar_type();
  TORCH_CHECK(g == at::kFloat || g == at::kHalf || g == at::kBFloat16,
              "topk_softmax: gating_output must be float32, float16 or bfloat16, got ", g);
  TORCH_CHECK(gating_output.dim() == 2 && topk_weights.dim() == 2 && topk_indices.dim() == 2 &&
                  token_expert_indices.dim() == 2,
              "topk_softmax: gating_output [num_tokens, num_experts] and the outputs [num_tokens, "
              "top_k] must be 2-D");
  const int64_t m = gating_output.size(0);
  const int64_t k = topk_weights.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_indices.sizes() &&
                  topk_weights.sizes() == token_expert_indices.sizes() && topk_weights.size(0) == m,
              "topk_softmax: topk_weights ", topk_weights.sizes(), ", topk_indices ",
              topk_indices.sizes(), " and token_expert_indices ", token_expert_indices.sizes(),
              " must all be [num_tokens=", m, ", top_k]");
  TORCH_CHECK(k >= 1 && k <= gating_output.size(1), "topk_softmax: top_k must be in [1, ",
              gating_output.size(1), "], got ", k);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat,
              "topk_softmax: topk_weights must be float32");
  TORCH_CHECK(moe_index_dtype(topk_indices.scalar_type()),
              "topk_softmax: topk_indices must be int32 or int64");
  TORCH_CHECK(token_expert_indices.scalar_type() == at::kInt,
              "topk_softmax: token_expert_indices must be int32");
  TORCH_CHECK(topk_weights.is_contiguous() && topk_indices.is_contiguous() &&
                  token_expert_indices.is_contiguous(),
              "topk_softmax: the outputs must be contiguous");
  TORCH_CHECK(gating_output.size(1) <= 1 || gating_output.stride(1) == 1,
              "topk_softmax: gating_output's last dimension must be contiguous");
  return k;
}

// moe_sum: input [M, top_k, H], output [M, H], same floating dtype, both contiguous.
inline void check_moe_sum(const at::Tensor& input, const at::Tensor& output) {
  const at::ScalarType t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "moe_sum: dtype must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(output.scalar_type() == t, "moe_sum: output dtype must match input's");
  TORCH_CHECK(input.dim() == 3 && output.dim() == 2 && input.size(0) == output.size(0) &&
                  input.size(2) == output.size(1),
              "moe_sum: input must be [num_tokens, top_k, hidden_size] and output [num_tokens, "
              "hidden_size], got ",
              input.sizes(), " and ", output.sizes());
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous(),
              "moe_sum: input and output must be contiguous");
}

// The most entries moe_align_block_size can write: every expert's count padded up to a multiple
// of block_size, for num_flat = M * top_k routed (token, expert) pairs.
inline int64_t moe_max_padded(int64_t num_flat, int64_t num_experts, int64_t block_size) {
  return num_flat + std::min(num_experts, num_flat) * (block_size - 1);
}

// moe_align_block_size: topk_ids [M, top_k] int32/int64 (contiguous); sorted_token_ids
// [>= moe_max_padded] int32; experts_ids [>= ceil(moe_max_padded / block_size)] int32;
// num_tokens_post_pad [1] int32; expert_map [num_experts] int32 or None.
inline void check_moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts,
                                       int64_t block_size, const at::Tensor& sorted_token_ids,
                                       const at::Tensor& experts_ids,
                                       const at::Tensor& num_tokens_post_pad,
                                       const std::optional<at::Tensor>& expert_map) {
  TORCH_CHECK(moe_index_dtype(topk_ids.scalar_type()) && topk_ids.is_contiguous(),
              "moe_align_block_size: topk_ids must be contiguous int32 or int64");
  TORCH_CHECK(num_experts >= 1, "moe_align_block_size: num_experts must be >= 1, got ",
              num_experts);
  TORCH_CHECK(block_size >= 1, "moe_align_block_size: block_size must be >= 1, got ", block_size);
  TORCH_CHECK(topk_ids.numel() < (int64_t{1} << 30),
              "moe_align_block_size: too many (token, expert) pairs: ", topk_ids.numel());
  for (const at::Tensor* t : {&sorted_token_ids, &experts_ids, &num_tokens_post_pad}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
                "moe_align_block_size: sorted_token_ids, experts_ids and num_tokens_post_pad must "
                "be contiguous 1-D int32");
  }
  const int64_t max_padded = moe_max_padded(topk_ids.numel(), num_experts, block_size);
  TORCH_CHECK(sorted_token_ids.numel() >= max_padded, "moe_align_block_size: sorted_token_ids ",
              "needs at least ", max_padded, " entries, got ", sorted_token_ids.numel());
  TORCH_CHECK(experts_ids.numel() >= (max_padded + block_size - 1) / block_size,
              "moe_align_block_size: experts_ids needs at least ",
              (max_padded + block_size - 1) / block_size, " entries, got ", experts_ids.numel());
  TORCH_CHECK(num_tokens_post_pad.numel() == 1,
              "moe_align_block_size: num_tokens_post_pad must hold one element");
  if (expert_map) {
    TORCH_CHECK(expert_map->scalar_type() == at::kInt && expert_map->dim() == 1 &&
                    expert_map->numel() == num_experts && expert_map->is_contiguous(),
                "moe_align_block_size: expert_map must be contiguous int32 [num_experts=",
                num_experts, "]");
  }
}

// The sizes of a checked fused_moe_gemm call.
struct FusedMoeGemmShape {
  int64_t num_flat;      // rows of out: M * top_k routed pairs
  int64_t num_experts;   // E (local experts)
  int64_t n;             // rows of each expert's weight (2 * I with SiLU-and-mul)
  int64_t k;             // the reduction size (input columns)
  int64_t out_cols;      // n, or n / 2 with SiLU-and-mul
  int64_t input_stride;  // input's row stride
  int64_t num_blocks;    // entries of expert_ids
  int64_t num_sorted;    // entries of sorted_token_ids (rows past it are never read)
};

// The routing buffers of moe_align_block_size as the expert kernels read them: sorted_token_ids,
// expert_ids and num_tokens_post_padded contiguous 1-D int32, one expert id per block of
// block_size sorted entries, one padded count.
inline void check_moe_routing_buffers(const char* op, const at::Tensor& sorted_token_ids,
                                      const at::Tensor& expert_ids,
                                      const at::Tensor& num_tokens_post_padded,
                                      int64_t block_size) {
  for (const at::Tensor* x : {&sorted_token_ids, &expert_ids, &num_tokens_post_padded}) {
    TORCH_CHECK(x->scalar_type() == at::kInt && x->dim() == 1 && x->is_contiguous(), op,
                ": sorted_token_ids, expert_ids and num_tokens_post_padded must be contiguous 1-D "
                "int32");
  }
  TORCH_CHECK(num_tokens_post_padded.numel() == 1, op,
              ": num_tokens_post_padded must hold one element");
  TORCH_CHECK(expert_ids.numel() == (sorted_token_ids.numel() + block_size - 1) / block_size, op,
              ": expert_ids needs one entry per block of ", block_size,
              " entries of sorted_token_ids (", sorted_token_ids.numel(), "), got ",
              expert_ids.numel());
}

// fused_moe_gemm: input [num_input_rows, K] (last dim contiguous); weight [E, N, K] contiguous;
// out [num_flat, N or N / 2] contiguous; topk_weights [num_flat] float32 (contiguous) or None;
// sorted_token_ids [num_padded] int32; expert_ids [num_padded / block_size] int32;
// num_tokens_post_padded [1] int32. Row f of out reads input row f / top_k.
inline FusedMoeGemmShape check_fused_moe_gemm(
    const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& topk_weights, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, int64_t top_k,
    int64_t block_size, bool silu_and_mul) {
  const char* op = "fused_moe_gemm";
  const at::ScalarType t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(weight.scalar_type() == t && out.scalar_type() == t, op,
              ": out and weight dtypes must match input's ", t);
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 3 && out.dim() == 2, op,
              ": input [rows, K], weight [num_experts, N, K] and out [num_flat, N'] expected, got ",
              input.sizes(), ", ", weight.sizes(), ", ", out.sizes());
  TORCH_CHECK(top_k >= 1 && block_size >= 1, op, ": top_k and block_size must be >= 1");
  const int64_t n = weight.size(1);
  const int64_t k = weight.size(2);
  TORCH_CHECK(input.size(1) == k, op, ": input has ", input.size(1), " columns, weight's K is ", k);
  TORCH_CHECK(!silu_and_mul || n % 2 == 0, op, ": SiLU-and-mul needs an even N, got ", n);
  const int64_t out_cols = silu_and_mul ? n / 2 : n;
  TORCH_CHECK(out.size(1) == out_cols, op, ": out needs ", out_cols, " columns, got ", out.size(1));
  const int64_t num_flat = out.size(0);
  TORCH_CHECK(input.size(0) * top_k >= num_flat, op, ": input has ", input.size(0),
              " rows, too few for ", num_flat, " output rows at top_k=", top_k);
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous(), op,
              ": weight and out must be contiguous");
  TORCH_CHECK(k <= 1 || input.stride(1) == 1, op, ": input's last dimension must be contiguous");
  if (topk_weights) {
    TORCH_CHECK(topk_weights->scalar_type() == at::kFloat && topk_weights->is_contiguous() &&
                    topk_weights->numel() == num_flat,
                op, ": topk_weights must be contiguous float32 with num_flat=", num_flat,
                " elements, got ", topk_weights->sizes());
  }
  check_moe_routing_buffers(op, sorted_token_ids, expert_ids, num_tokens_post_padded, block_size);
  const int64_t in_stride = input.size(0) <= 1 ? k : input.stride(0);
  return {num_flat,           weight.size(0),          n, k, out_cols, in_stride,
          expert_ids.numel(), sorted_token_ids.numel()};
}

}  // namespace pyorch
