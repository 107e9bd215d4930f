// silu_and_mul_dynamic_per_token_quant as the ops it fuses, for both backends: silu_and_mul into
// a temporary of input's dtype, then dynamic_per_token_scaled_fp8_quant of it. The CPU op is
// exactly this; the CUDA op runs one kernel where it can (pyorch/quantization.h) and this
// elsewhere, with the same bits either way. Arguments are checked by the caller
// (check_silu_and_mul_dynamic_per_token_quant).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace pyorch {

// Ops: a type with static silu_and_mul(out, input) and dynamic_per_token_scaled_fp8_quant(out,
// input, scales, scale_ub) (the structs in cpp/cpu/quantization.cpp and cpp/ops/quantization.cpp).
template <typename Ops>
void silu_and_mul_dynamic_per_token_quant_composed(at::Tensor& result,       // [..., d] fp8
                                                   const at::Tensor& input,  // [..., 2 * d]
                                                   at::Tensor& scales,       // [num_tokens, 1]
                                                   const std::optional<at::Tensor>& scale_ub) {
  at::Tensor act = at::empty(result.sizes(), input.options());  // [..., d], contiguous
  Ops::silu_and_mul(act, input);
  Ops::dynamic_per_token_scaled_fp8_quant(result, act, scales, scale_ub);
}

}  // namespace pyorch
