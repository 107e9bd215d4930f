// ggml_mul_mat_vec_fused as the ops it fuses, for both backends: rms_norm / silu_and_mul, then
// ggml_mul_mat_vec_a8, then a store or an add. The CPU kernel is this (cpp/cpu/gguf.cpp); the CUDA
// adapter runs it where no fused kernel takes the arguments (cpp/ops/gguf.cpp).
#pragma once

#include <optional>

#include <ATen/ATen.h>

#include "gguf_checks.h"

namespace pyorch::gguf {

// Ops: a type with static rms_norm(out, x, weight, eps), silu_and_mul(out, x) and
// mul_mat_vec(W, x, quant_type, row) -> Tensor of one backend.
template <class Ops>
void ggml_mul_mat_vec_fused_composed(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,
                                     int64_t quant_type, int64_t row,
                                     const std::optional<at::Tensor>& norm_weight, double eps,
                                     const FusedArgs& a) {
  at::Tensor x = X;
  if (a.input == FusedInput::kRmsNorm) {
    x = at::empty({X.size(0), a.cols}, X.options());
    Ops::rms_norm(x, X, *norm_weight, eps);
  } else if (a.input == FusedInput::kSiluAndMul) {
    x = at::empty({X.size(0), a.cols}, X.options());
    Ops::silu_and_mul(x, X);
  }
  const at::Tensor y = Ops::mul_mat_vec(W, x, quant_type, row);
  if (a.add) {
    out.add_(y);  // in float, rounded once to out's dtype: the residual stream's add
  } else {
    out.copy_(y);
  }
}

}  // namespace pyorch::gguf
