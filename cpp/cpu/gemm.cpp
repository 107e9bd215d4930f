// CPU skinny_gemm and skinny_gemm_fused: out = input @ weight^T (+ bias) in fp32, rounded once,
// like the CUDA kernel, with the fused norm and epilogues rounded where it rounds.
// A plain kernel for few rows: the weight row is widened to fp32 once and dotted with every
// token; the dot keeps 8 partial sums so that the compiler can vectorize it (input_size is a
// multiple of 8).
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "gemm_checks.h"
#include "gemm_fp8_checks.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

constexpr int kLanes = 8;

float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float lanes[kLanes] = {};
  for (int64_t k = 0; k < n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[k + j] * b[k + j];
  }
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

// out = epilogue(norm(x) @ w^T + b): skinny_gemm and skinny_gemm_fused (see the CUDA API,
// cuda/include/pyorch/gemm.h, for the rounding each step copies). W: T, or e4m3 weights
// (skinny_gemm_fp8) whose fp32 dot is multiplied by w_scale (per row, or [0] for all).
template <typename T, typename W = T>
void skinny_gemm_impl(const SkinnyGemmShape& s, const T* x, const W* w, const T* b, const T* g,
                      float eps, SkinnyFusedEpilogue epilogue, T* o, const float* w_scale = nullptr,
                      bool w_scale_per_row = false) {
  const int64_t K = s.input_size;
  const bool paired = epilogue == SkinnyFusedEpilogue::kSiluMul;
  const int64_t half = s.output_size / 2;
  const int64_t columns = paired ? half : s.output_size;
  std::vector<float> xf(s.num_tokens * K);  // [num_tokens, input_size], normed inputs x * g
  std::vector<float> scale(s.num_tokens, 1.f);
  for (int64_t m = 0; m < s.num_tokens; ++m) {
    float* row = &xf[m * K];
    to_float(x + m * s.input_stride, row, K);
    if (g == nullptr) continue;
    float sum_sq = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      sum_sq += row[k] * row[k];
      row[k] = round_to<T>(row[k] * static_cast<float>(g[k]));
    }
    scale[m] = 1.f / std::sqrt(sum_sq / static_cast<float>(K) + eps);
  }
  at::parallel_for(0, columns, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K), uf(paired ? K : 0);  // one weight row (and its up row)
    for (int64_t n = begin; n < end; ++n) {
      to_float(w + n * K, wf.data(), K);
      if (paired) to_float(w + (half + n) * K, uf.data(), K);
      const float bn = b ? static_cast<float>(b[n]) : 0.f;
      const float bu = b && paired ? static_cast<float>(b[half + n]) : 0.f;
      const float sn = w_scale ? w_scale[w_scale_per_row ? n : 0] : 1.f;
      const float su = w_scale && paired ? w_scale[w_scale_per_row ? half + n : 0] : 1.f;
      for (int64_t m = 0; m < s.num_tokens; ++m) {
        const float p = dot(&xf[m * K], wf.data(), K) * scale[m] * sn + bn;
        T& out = o[m * s.out_stride + n];
        if (paired) {
          const float gate = round_to<T>(p);
          const float up = round_to<T>(dot(&xf[m * K], uf.data(), K) * scale[m] * su + bu);
          out = static_cast<T>(gate / (1.f + std::exp(-gate)) * up);
        } else if (epilogue == SkinnyFusedEpilogue::kAdd) {
          out = static_cast<T>(round_to<T>(p) + static_cast<float>(out));
        } else {
          out = static_cast<T>(p);
        }
      }
    }
  });
}

}  // namespace

void skinny_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu() &&
                  (!bias || bias->device().is_cpu()),
              "skinny_gemm: tensors must be on CPU");
  const SkinnyGemmShape s = check_skinny_gemm(out, input, weight, bias);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "skinny_gemm", [&] {
    skinny_gemm_impl<scalar_t>(s, input.const_data_ptr<scalar_t>(),
                               weight.const_data_ptr<scalar_t>(),
                               bias ? bias->const_data_ptr<scalar_t>() : nullptr, nullptr, 0.f,
                               SkinnyFusedEpilogue::kStore, out.data_ptr<scalar_t>());
  });
}

void skinny_gemm_fused(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& norm_weight, double epsilon,
                       int64_t epilogue, std::optional<bool> /*pdl: a launch detail of CUDA*/) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu() &&
                  (!bias || bias->device().is_cpu()) &&
                  (!norm_weight || norm_weight->device().is_cpu()),
              "skinny_gemm_fused: tensors must be on CPU");
  const SkinnyGemmShape s =
      check_skinny_gemm_fused(out, input, weight, bias, norm_weight, epilogue);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "skinny_gemm_fused", [&] {
    skinny_gemm_impl<scalar_t>(
        s, input.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
        bias ? bias->const_data_ptr<scalar_t>() : nullptr,
        norm_weight ? norm_weight->const_data_ptr<scalar_t>() : nullptr,
        static_cast<float>(epsilon), static_cast<SkinnyFusedEpilogue>(epilogue),
        out.data_ptr<scalar_t>());
  });
}

void skinny_gemm_fp8(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& norm_weight, double epsilon, int64_t epilogue,
                     std::optional<bool> /*pdl: a launch detail of CUDA*/) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu() &&
                  weight_scale.device().is_cpu() && (!bias || bias->device().is_cpu()) &&
                  (!norm_weight || norm_weight->device().is_cpu()),
              "skinny_gemm_fp8: tensors must be on CPU");
  bool per_channel = false;
  const SkinnyGemmShape s = check_skinny_gemm_fp8(out, input, weight, weight_scale, bias,
                                                  norm_weight, epilogue, &per_channel);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "skinny_gemm_fp8", [&] {
    skinny_gemm_impl<scalar_t, c10::Float8_e4m3fn>(
        s, input.const_data_ptr<scalar_t>(), weight.const_data_ptr<c10::Float8_e4m3fn>(),
        bias ? bias->const_data_ptr<scalar_t>() : nullptr,
        norm_weight ? norm_weight->const_data_ptr<scalar_t>() : nullptr,
        static_cast<float>(epsilon), static_cast<SkinnyFusedEpilogue>(epilogue),
        out.data_ptr<scalar_t>(), weight_scale.const_data_ptr<float>(), per_channel);
  });
}

}  // namespace pyorch::cpu
