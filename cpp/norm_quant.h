// rms_norm_dynamic_per_token_quant as the ops it fuses, for both backends: rms_norm (or, with a
// residual, fused_add_rms_norm on a copy of input, which updates the residual) into a temporary
// of input's dtype, then dynamic_per_token_scaled_fp8_quant of it. The CPU op is exactly this;
// the CUDA op runs one kernel where it can (pyorch/quantization.h) and this elsewhere, with the
// same bits either way. Arguments are checked by the caller
// (check_rms_norm_dynamic_per_token_quant).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

namespace pyorch {

// Ops: a type with static rms_norm(out, input, weight, eps), fused_add_rms_norm(input, residual,
// weight, eps) and dynamic_per_token_scaled_fp8_quant(out, input, scales, scale_ub).
template <typename Ops>
void rms_norm_dynamic_per_token_quant_composed(at::Tensor& result, const at::Tensor& input,
                                               const at::Tensor& weight, at::Tensor& scales,
                                               double eps,
                                               const std::optional<at::Tensor>& scale_ub,
                                               std::optional<at::Tensor>& residual) {
  at::Tensor normed;
  if (residual) {  // fused_add_rms_norm writes the normed rows over its input: a copy of input
    normed = input.clone(at::MemoryFormat::Contiguous);
    Ops::fused_add_rms_norm(normed, *residual, weight, eps);
  } else {
    normed = at::empty_like(input, at::MemoryFormat::Contiguous);
    Ops::rms_norm(normed, input, weight, eps);
  }
  Ops::dynamic_per_token_scaled_fp8_quant(result, normed, scales, scale_ub);
}

}  // namespace pyorch
