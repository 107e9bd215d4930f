// Argument checks shared by the CPU kernels (cpp/cpu/moe_grouped.cpp) and the CUDA adapters
// (cpp/ops/moe_grouped.cpp) of the MoE prefill path: moe_grouped_permute, moe_grouped_gemm and
// moe_grouped_unpermute (contracts in cuda/include/pyorch/moe_grouped.h).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

inline bool moe_grouped_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// input [M, H] (last dim contiguous; float32/16, bf16 or fp8 e4m3); topk_ids [M, top_k]
// int32/int64 contiguous; expert_map [num_experts] int32 or None; permuted [M * top_k, H] of
// input's dtype; expert_offsets [E_local + 1] int32; inv_perm [M, top_k] int32; outputs
// contiguous. Returns the number of local experts.
inline int64_t check_moe_grouped_permute(const at::Tensor& input, const at::Tensor& topk_ids,
                                         int64_t num_experts,
                                         const std::optional<at::Tensor>& expert_map,
                                         const at::Tensor& permuted,
                                         const at::Tensor& expert_offsets,
                                         const at::Tensor& inv_perm) {
  const char* op = "moe_grouped_permute";
  const at::ScalarType t = input.scalar_type();
  TORCH_CHECK(moe_grouped_float(t) || t == at::kFloat8_e4m3fn, op,
              ": input must be float32, float16, bfloat16 or float8_e4m3fn, got ", t);
  TORCH_CHECK(input.dim() == 2 && topk_ids.dim() == 2, op,
              ": input [num_tokens, hidden] and topk_ids [num_tokens, top_k] must be 2-D, got ",
              input.sizes(), " and ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.size(0) == input.size(0), op, ": topk_ids has ", topk_ids.size(0),
              " rows, input ", input.size(0));
  TORCH_CHECK((topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong) &&
                  topk_ids.is_contiguous(),
              op, ": topk_ids must be contiguous int32 or int64");
  TORCH_CHECK(topk_ids.size(1) >= 1, op, ": top_k must be >= 1");
  TORCH_CHECK(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(input.size(1) <= 1 || input.stride(1) == 1, op,
              ": input's last dimension must be contiguous");
  const int64_t num_flat = topk_ids.numel();
  TORCH_CHECK(permuted.scalar_type() == t && permuted.dim() == 2 && permuted.is_contiguous() &&
                  permuted.size(0) == num_flat && permuted.size(1) == input.size(1),
              op, ": permuted must be contiguous ", t, " [num_tokens * top_k=", num_flat,
              ", hidden=", input.size(1), "], got ", permuted.scalar_type(), " ", permuted.sizes());
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 &&
                  expert_offsets.is_contiguous() && expert_offsets.numel() >= 2,
              op, ": expert_offsets must be contiguous 1-D int32 [num_local_experts + 1]");
  TORCH_CHECK(inv_perm.scalar_type() == at::kInt && inv_perm.is_contiguous() &&
                  inv_perm.sizes() == topk_ids.sizes(),
              op, ": inv_perm must be contiguous int32 shaped like topk_ids ", topk_ids.sizes(),
              ", got ", inv_perm.sizes());
  TORCH_CHECK(num_flat < (int64_t{1} << 31), op, ": too many (token, expert) pairs");
  const int64_t num_local = expert_offsets.numel() - 1;
  if (expert_map) {
    TORCH_CHECK(expert_map->scalar_type() == at::kInt && expert_map->dim() == 1 &&
                    expert_map->numel() == num_experts && expert_map->is_contiguous(),
                op, ": expert_map must be contiguous int32 [num_experts=", num_experts, "]");
  } else {
    TORCH_CHECK(num_local == num_experts, op, ": without expert_map expert_offsets needs ",
                num_experts + 1, " entries, got ", expert_offsets.numel());
  }
  return num_local;
}

// The sizes of a checked moe_grouped_gemm call.
struct MoeGroupedGemmShape {
  int64_t rows, num_experts, n, k;
};

// out [rows, N] = a [rows, K] @ weight[e] [N, K]^T per expert over expert_offsets [E + 1] int32;
// a/weight float32/16, bf16 (out the same dtype, alpha None) or fp8 e4m3 (out bf16, alpha [E]
// float32 required). All contiguous.
inline MoeGroupedGemmShape check_moe_grouped_gemm(const at::Tensor& out, const at::Tensor& a,
                                                  const at::Tensor& weight,
                                                  const at::Tensor& expert_offsets,
                                                  const std::optional<at::Tensor>& alpha) {
  const char* op = "moe_grouped_gemm";
  const at::ScalarType t = a.scalar_type();
  const bool fp8 = t == at::kFloat8_e4m3fn;
  TORCH_CHECK(moe_grouped_float(t) || fp8, op,
              ": a must be float32, float16, bfloat16 or float8_e4m3fn, got ", t);
  TORCH_CHECK(weight.scalar_type() == t, op, ": weight dtype ", weight.scalar_type(),
              " must match a's ", t);
  TORCH_CHECK(fp8 ? out.scalar_type() == at::kBFloat16 : out.scalar_type() == t, op,
              ": out must be ", fp8 ? at::kBFloat16 : t, ", got ", out.scalar_type());
  TORCH_CHECK(a.dim() == 2 && weight.dim() == 3 && out.dim() == 2, op,
              ": a [rows, K], weight [num_experts, N, K] and out [rows, N] expected, got ",
              a.sizes(), ", ", weight.sizes(), ", ", out.sizes());
  TORCH_CHECK(a.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), op,
              ": a, weight and out must be contiguous");
  const int64_t e = weight.size(0), n = weight.size(1), k = weight.size(2);
  TORCH_CHECK(a.size(1) == k && out.size(1) == n && out.size(0) == a.size(0), op, ": a ", a.sizes(),
              " and out ", out.sizes(), " do not fit weight ", weight.sizes());
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 &&
                  expert_offsets.is_contiguous() && expert_offsets.numel() == e + 1,
              op, ": expert_offsets must be contiguous 1-D int32 [num_experts + 1 = ", e + 1,
              "], got ", expert_offsets.sizes());
  if (fp8) {
    TORCH_CHECK(alpha && alpha->scalar_type() == at::kFloat && alpha->is_contiguous() &&
                    alpha->numel() == e,
                op, ": fp8 operands need alpha, contiguous float32 [num_experts=", e, "]");
  } else {
    TORCH_CHECK(!alpha, op, ": alpha is for fp8 operands only");
  }
  return {a.size(0), e, n, k};
}

// permuted [*, H] and output [M, H] of one floating dtype; inv_perm [M, top_k] int32;
// topk_weights [M, top_k] float32 or None. All contiguous. Returns top_k.
inline int64_t check_moe_grouped_unpermute(const at::Tensor& permuted, const at::Tensor& inv_perm,
                                           const std::optional<at::Tensor>& topk_weights,
                                           const at::Tensor& output) {
  const char* op = "moe_grouped_unpermute";
  const at::ScalarType t = permuted.scalar_type();
  TORCH_CHECK(moe_grouped_float(t), op, ": dtype must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(output.scalar_type() == t, op, ": output dtype must match permuted's");
  TORCH_CHECK(permuted.dim() == 2 && output.dim() == 2 && inv_perm.dim() == 2 &&
                  permuted.size(1) == output.size(1) && inv_perm.size(0) == output.size(0),
              op, ": permuted [rows, H], inv_perm [M, top_k] and output [M, H] expected, got ",
              permuted.sizes(), ", ", inv_perm.sizes(), ", ", output.sizes());
  TORCH_CHECK(inv_perm.scalar_type() == at::kInt && inv_perm.is_contiguous(), op,
              ": inv_perm must be contiguous int32");
  TORCH_CHECK(permuted.is_contiguous() && output.is_contiguous(), op,
              ": permuted and output must be contiguous");
  if (topk_weights) {
    TORCH_CHECK(topk_weights->scalar_type() == at::kFloat && topk_weights->is_contiguous() &&
                    topk_weights->sizes() == inv_perm.sizes(),
                op, ": topk_weights must be contiguous float32 ", inv_perm.sizes(), ", got ",
                topk_weights->sizes());
  }
  return inv_perm.size(1);
}

}  // namespace pyorch
