// Argument checks shared by the CPU kernels (cpp/cpu/activation.cpp) and the CUDA adapters
// (cpp/ops/activation.cpp) of the gated activations, so both backends accept the same inputs.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

// Row stride of x viewed as [rows, x.size(-1)]. The leading dims must collapse into one; size-1
// dims are skipped, and with no leading dim of size > 1 the natural stride is returned.
inline int64_t act_row_stride(const at::Tensor& x, const char* op) {
  int64_t stride = x.size(-1);
  int64_t inner = -1;  // the last visited leading dim of size > 1 (inside d)
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (inner < 0) stride = x.stride(d);
    TORCH_CHECK(inner < 0 || x.stride(d) == x.stride(inner) * x.size(inner), op,
                ": leading dimensions must be collapsible into rows");
    inner = d;
  }
  return stride;
}

// Checks out [..., d] against input [..., 2 * d] (dtype, shape, contiguous last dim); returns d.
inline int64_t check_act_and_mul(const at::Tensor& out, const at::Tensor& input, const char* op) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out dtype must match input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op,
              ": the last dimension of input must be even, got ", input.sizes());
  const int64_t d = input.size(-1) / 2;
  TORCH_CHECK(out.dim() == input.dim() && out.size(-1) == d &&
                  out.sizes().slice(0, out.dim() - 1) == input.sizes().slice(0, input.dim() - 1),
              op, ": out must be input's shape with the last dimension halved, got out ",
              out.sizes(), " for input ", input.sizes());
  TORCH_CHECK((input.size(-1) <= 1 || input.stride(-1) == 1) && (d <= 1 || out.stride(-1) == 1), op,
              ": the last dimension must be contiguous");
  return d;
}

}  // namespace pyorch
