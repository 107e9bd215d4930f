// CPU skinny_gemm: out = input @ weight^T (+ bias) in fp32, rounded once, like the CUDA kernel.
// A plain kernel for few rows: the weight row is widened to fp32 once and dotted with every
// token; the dot keeps 8 partial sums so that the compiler can vectorize it (input_size is a
// multiple of 8).
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "gemm_checks.h"
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

}  // namespace

void skinny_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu() &&
                  (!bias || bias->device().is_cpu()),
              "skinny_gemm: tensors must be on CPU");
  const SkinnyGemmShape s = check_skinny_gemm(out, input, weight, bias);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "skinny_gemm", [&] {
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const scalar_t* b = bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t K = s.input_size;
    std::vector<float> xf(s.num_tokens * K);  // [num_tokens, input_size]
    for (int64_t m = 0; m < s.num_tokens; ++m) to_float(x + m * s.input_stride, &xf[m * K], K);
    at::parallel_for(0, s.output_size, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> wf(K);  // one weight row
      for (int64_t n = begin; n < end; ++n) {
        to_float(w + n * K, wf.data(), K);
        const float bn = b ? static_cast<float>(b[n]) : 0.f;
        for (int64_t m = 0; m < s.num_tokens; ++m) {
          o[m * s.out_stride + n] = static_cast<scalar_t>(dot(&xf[m * K], wf.data(), K) + bn);
        }
      }
    });
  });
}

}  // namespace pyorch::cpu
