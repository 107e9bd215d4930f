// CPU RMSNorm: one row per task, fp32 accumulation, rounding where HF's reference rounds.
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

void check_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": tensors must be on CPU");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(), op,
              ": weight must be [hidden_size] = [", x.size(-1), "] and contiguous, got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype must match input");
}

// y = round(x * inv_rms) * w, written to out (x already in fp32).
template <typename T>
void normalize_row(const float* x, const T* w, T* out, int64_t hidden, float inv_rms) {
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = static_cast<T>(round_to<T>(x[i] * inv_rms) * static_cast<float>(w[i]));
  }
}

float inv_rms_of(const float* x, int64_t hidden, double eps) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < hidden; ++i) sum_sq += x[i] * x[i];
  return 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + static_cast<float>(eps));
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_args(input, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && out.scalar_type() == input.scalar_type(),
              "rms_norm: out must match input's shape and dtype");
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  const int64_t in_stride = row_stride(input, "rms_norm");
  const int64_t out_stride = row_stride(out, "rms_norm");
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(hidden);
      for (int64_t r = begin; r < end; ++r) {
        to_float(in + r * in_stride, buf.data(), hidden);
        normalize_row(buf.data(), w, o + r * out_stride, hidden,
                      inv_rms_of(buf.data(), hidden, eps));
      }
    });
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_args(input, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type(),
              "fused_add_rms_norm: residual must match input's shape and dtype");
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  const int64_t in_stride = row_stride(input, "fused_add_rms_norm");
  const int64_t res_stride = row_stride(residual, "fused_add_rms_norm");
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(hidden);
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x + r * in_stride;
        scalar_t* rr = res + r * res_stride;
        for (int64_t i = 0; i < hidden; ++i) {
          // The residual stream is stored in T, so the sum is rounded before it is normalized.
          const scalar_t s =
              static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          rr[i] = s;
          buf[i] = static_cast<float>(s);
        }
        normalize_row(buf.data(), w, xr, hidden, inv_rms_of(buf.data(), hidden, eps));
      }
    });
  });
}

}  // namespace pyorch::cpu
