// CPU kernels of the MoE prefill path (moe_grouped_permute, moe_grouped_gemm,
// moe_grouped_unpermute): same contracts as the CUDA kernels (cuda/include/pyorch/moe_grouped.h),
// with one expert's rows in pair order (the CUDA sort leaves that order unspecified).
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "moe_grouped_checks.h"
#include "ops.h"

namespace pyorch::cpu {

void moe_grouped_permute(const at::Tensor& input, const at::Tensor& topk_ids, int64_t num_experts,
                         const std::optional<at::Tensor>& expert_map, at::Tensor& permuted,
                         at::Tensor& expert_offsets, at::Tensor& inv_perm) {
  const int64_t num_local = check_moe_grouped_permute(input, topk_ids, num_experts, expert_map,
                                                      permuted, expert_offsets, inv_perm);
  const int64_t num_flat = topk_ids.numel();
  const int64_t top_k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.to(at::kLong);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> local(num_flat);
  std::vector<int32_t> counts(num_local + 1, 0);
  for (int64_t f = 0; f < num_flat; ++f) {
    int64_t e = id[f] >= 0 && id[f] < num_experts ? (map ? map[id[f]] : id[f]) : -1;
    if (e >= num_local) e = -1;
    local[f] = e;
    if (e >= 0) ++counts[e + 1];
  }
  int32_t* offsets = expert_offsets.data_ptr<int32_t>();
  offsets[0] = 0;
  for (int64_t e = 0; e < num_local; ++e) offsets[e + 1] = offsets[e] + counts[e + 1];
  std::vector<int32_t> cursor(offsets, offsets + num_local);
  int32_t* inv = inv_perm.data_ptr<int32_t>();
  for (int64_t f = 0; f < num_flat; ++f) inv[f] = local[f] >= 0 ? cursor[local[f]]++ : -1;
  const int64_t hidden = input.size(1);
  if (hidden == 0) return;
  const int64_t row_bytes = hidden * input.element_size();
  const int64_t in_stride = (input.size(0) <= 1 ? hidden : input.stride(0)) * input.element_size();
  const auto* src = static_cast<const char*>(input.const_data_ptr());
  auto* dst = static_cast<char*>(permuted.data_ptr());
  at::parallel_for(0, num_flat, 64, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f) {
      if (inv[f] >= 0)
        std::memcpy(dst + inv[f] * row_bytes, src + (f / top_k) * in_stride, row_bytes);
    }
  });
}

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                      const at::Tensor& expert_offsets, const std::optional<at::Tensor>& alpha) {
  const MoeGroupedGemmShape s = check_moe_grouped_gemm(out, a, weight, expert_offsets, alpha);
  const int32_t* offsets = expert_offsets.const_data_ptr<int32_t>();
  for (int64_t e = 0; e < s.num_experts; ++e) {
    TORCH_CHECK(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= s.rows,
                "moe_grouped_gemm: expert_offsets must rise from 0 to at most ", s.rows,
                " rows, got offsets[", e, ":", e + 2, "] = ", offsets[e], ", ", offsets[e + 1]);
  }
  for (int64_t e = 0; e < s.num_experts; ++e) {
    const int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    // fp32 products (fp32 operands stay fp32, the 16-bit and fp8 ones are exact in fp32), one
    // rounding to out's dtype.
    at::Tensor c =
        at::matmul(a.narrow(0, offsets[e], m).to(at::kFloat), weight[e].to(at::kFloat).t());
    if (alpha) c.mul_(alpha->select(0, e).item<float>());
    out.narrow(0, offsets[e], m).copy_(c);
  }
}

void moe_grouped_unpermute(const at::Tensor& permuted, const at::Tensor& inv_perm,
                           const std::optional<at::Tensor>& topk_weights, at::Tensor& output) {
  const int64_t top_k = check_moe_grouped_unpermute(permuted, inv_perm, topk_weights, output);
  const int64_t num_tokens = output.size(0);
  const int64_t hidden = output.size(1);
  const int64_t rows = permuted.size(0);
  const int32_t* inv = inv_perm.const_data_ptr<int32_t>();
  for (int64_t f = 0; f < num_tokens * top_k; ++f) {
    TORCH_CHECK(inv[f] >= -1 && inv[f] < rows, "moe_grouped_unpermute: inv_perm[", f,
                "] = ", inv[f], " is outside [-1, ", rows, ")");
  }
  const float* w = topk_weights ? topk_weights->const_data_ptr<float>() : nullptr;
  PYORCH_CPU_DISPATCH_FLOATS(permuted.scalar_type(), "moe_grouped_unpermute", [&] {
    const scalar_t* src = permuted.const_data_ptr<scalar_t>();
    scalar_t* dst = output.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden), row(hidden);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < top_k; ++j) {
          const int32_t r = inv[t * top_k + j];
          if (r < 0) continue;
          const float wt = w ? w[t * top_k + j] : 1.f;
          to_float(src + r * hidden, row.data(), hidden);
          for (int64_t c = 0; c < hidden; ++c) acc[c] += wt * row[c];
        }
        for (int64_t c = 0; c < hidden; ++c) dst[t * hidden + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
}

}  // namespace pyorch::cpu
