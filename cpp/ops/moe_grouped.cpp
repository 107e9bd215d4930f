// CUDA adapters of the MoE prefill path: check, guard, stream, call cuda/, check status.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "moe_grouped_checks.h"
#include "ops.h"
#include "pyorch/moe.h"
#include "pyorch/moe_grouped.h"

using pyorch::aligned16;
using pyorch::check_same_cuda;

void moe_grouped_permute(const at::Tensor& input, const at::Tensor& topk_ids, int64_t num_experts,
                         const std::optional<at::Tensor>& expert_map, at::Tensor& permuted,
                         at::Tensor& expert_offsets, at::Tensor& inv_perm) {
  const int64_t num_local = pyorch::check_moe_grouped_permute(
      input, topk_ids, num_experts, expert_map, permuted, expert_offsets, inv_perm);
  const char* op = "moe_grouped_permute";
  check_same_cuda({&input, &topk_ids, &permuted, &expert_offsets, &inv_perm}, op);
  if (expert_map) check_same_cuda({&input, &*expert_map}, op);
  TORCH_CHECK(num_local <= pyorch::kMoeMaxExperts, op, ": CUDA takes up to ",
              pyorch::kMoeMaxExperts, " local experts, got ", num_local);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  const int64_t hidden = input.size(1);
  PYORCH_CHECK_CUDA(pyorch::moe_grouped_permute(
      permuted.data_ptr(), expert_offsets.data_ptr<int32_t>(), inv_perm.data_ptr<int32_t>(),
      input.const_data_ptr(), pyorch::to_pyorch_dtype(input.scalar_type()),
      input.size(0) <= 1 ? hidden : input.stride(0), topk_ids.const_data_ptr(),
      pyorch::to_pyorch_dtype(topk_ids.scalar_type()),
      expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr, topk_ids.size(0),
      topk_ids.size(1), num_experts, num_local, hidden, c10::cuda::getCurrentCUDAStream()));
}

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                      const at::Tensor& expert_offsets, const std::optional<at::Tensor>& alpha) {
  const pyorch::MoeGroupedGemmShape s =
      pyorch::check_moe_grouped_gemm(out, a, weight, expert_offsets, alpha);
  const char* op = "moe_grouped_gemm";
  check_same_cuda({&out, &a, &weight, &expert_offsets}, op);
  if (alpha) check_same_cuda({&out, &*alpha}, op);
  TORCH_CHECK(pyorch::moe_grouped_gemm_available(), op,
              ": pyorch was built without the CUTLASS headers (pip install nvidia-cutlass, then "
              "rebuild), so the CUDA grouped expert GEMM is not available");
  const at::ScalarType t = a.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kFloat8_e4m3fn, op,
              ": CUDA takes bfloat16 or float8_e4m3fn operands, got ", t);
  TORCH_CHECK(s.n % 16 == 0 && s.k % 16 == 0, op, ": CUDA needs N (", s.n, ") and K (", s.k,
              ") to be multiples of 16");
  TORCH_CHECK(aligned16(out) && aligned16(a) && aligned16(weight), op,
              ": out, a and weight must be 16-byte aligned");
  if (s.rows == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const pyorch::DType dtype = pyorch::to_pyorch_dtype(t);
  const size_t ws_bytes = pyorch::moe_grouped_gemm_workspace_size(s.num_experts, dtype);
  // Stream-ordered from torch's caching allocator: graph-capturable, freed after the launch.
  at::Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, a.options().dtype(at::kByte));
  PYORCH_CHECK_CUDA(pyorch::moe_grouped_gemm(
      out.data_ptr(), a.const_data_ptr(), weight.const_data_ptr(),
      expert_offsets.const_data_ptr<int32_t>(), alpha ? alpha->const_data_ptr<float>() : nullptr,
      dtype, s.rows, s.num_experts, s.n, s.k, workspace.data_ptr(), ws_bytes,
      c10::cuda::getCurrentCUDAStream()));
}

void moe_grouped_unpermute(const at::Tensor& permuted, const at::Tensor& inv_perm,
                           const std::optional<at::Tensor>& topk_weights, at::Tensor& output) {
  const int64_t top_k =
      pyorch::check_moe_grouped_unpermute(permuted, inv_perm, topk_weights, output);
  const char* op = "moe_grouped_unpermute";
  check_same_cuda({&permuted, &inv_perm, &output}, op);
  if (topk_weights) check_same_cuda({&output, &*topk_weights}, op);
  const c10::cuda::OptionalCUDAGuard guard(output.device());
  PYORCH_CHECK_CUDA(pyorch::moe_grouped_unpermute(
      output.data_ptr(), permuted.const_data_ptr(), inv_perm.const_data_ptr<int32_t>(),
      topk_weights ? topk_weights->const_data_ptr<float>() : nullptr,
      pyorch::to_pyorch_dtype(output.scalar_type()), output.size(0), top_k, output.size(1),
      c10::cuda::getCurrentCUDAStream()));
}
