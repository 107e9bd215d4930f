// CUDA adapters for the norms: check, guard, stream, call cuda/, check status. No math here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/norm.h"

namespace {

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.is_cuda() && weight.is_cuda(), op, ": tensors must be on CUDA");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, op, ": the last dimension must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(), op,
              ": weight must be [hidden_size] = [", x.size(-1), "] and contiguous, got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype must match input");
}

// Row stride of a tensor viewed as [num_tokens, hidden_size]; leading dims must collapse.
int64_t row_stride(const at::Tensor& x, const char* op) {
  if (x.dim() == 1) return x.size(0);
  for (int64_t d = 0; d + 2 < x.dim(); ++d) {
    TORCH_CHECK(x.stride(d) == x.stride(d + 1) * x.size(d + 1), op,
                ": leading dimensions must be collapsible into rows");
  }
  return x.stride(-2);
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_norm_args(input, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && out.scalar_type() == input.scalar_type() &&
                  out.stride(-1) == 1,
              "rms_norm: out must match input's shape and dtype");
  const int64_t hidden = input.size(-1);
  const int64_t num_tokens = hidden == 0 ? 0 : input.numel() / hidden;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::rms_norm(
      out.data_ptr(), input.data_ptr(), weight.data_ptr(),
      pyorch::to_pyorch_dtype(input.scalar_type()), num_tokens, hidden, row_stride(out, "rms_norm"),
      row_stride(input, "rms_norm"), static_cast<float>(eps), c10::cuda::getCurrentCUDAStream()));
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm_args(input, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type() &&
                  residual.stride(-1) == 1,
              "fused_add_rms_norm: residual must match input's shape and dtype");
  const int64_t hidden = input.size(-1);
  const int64_t num_tokens = hidden == 0 ? 0 : input.numel() / hidden;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::fused_add_rms_norm(
      input.data_ptr(), residual.data_ptr(), weight.data_ptr(),
      pyorch::to_pyorch_dtype(input.scalar_type()), num_tokens, hidden,
      row_stride(input, "fused_add_rms_norm"), row_stride(residual, "fused_add_rms_norm"),
      static_cast<float>(eps), c10::cuda::getCurrentCUDAStream()));
}
