// CUDA adapters for the gated activations: check, guard, stream, call cuda/, check status.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "activation_checks.h"
#include "common.h"
#include "ops.h"
#include "pyorch/activation.h"

namespace {

// out: [..., d], input: [..., 2 * d].
void act_and_mul(at::Tensor& out, const at::Tensor& input, pyorch::Activation act, const char* op) {
  TORCH_CHECK(out.is_cuda() && input.is_cuda() && out.device() == input.device(), op,
              ": tensors must be on the same CUDA device");
  const at::ScalarType dtype = input.scalar_type();
  const int64_t d = pyorch::check_act_and_mul(out, input, op);
  const int64_t num_tokens = d == 0 ? 0 : out.numel() / d;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::act_and_mul(
      out.data_ptr(), input.const_data_ptr(), act, pyorch::to_pyorch_dtype(dtype), num_tokens, d,
      pyorch::act_row_stride(out, op), pyorch::act_row_stride(input, op),
      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul(out, input, pyorch::Activation::kSilu, "silu_and_mul");
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul(out, input, pyorch::Activation::kGelu, "gelu_and_mul");
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul(out, input, pyorch::Activation::kGeluTanh, "gelu_tanh_and_mul");
}
