// CUDA adapters for the gated activations: check, guard, stream, call cuda/, check status.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/activation.h"

namespace {

// Row stride of x viewed as [rows, x.size(-1)]. The leading dims must collapse into one; size-1
// dims are skipped, and with no leading dim of size > 1 the natural stride is returned (it only
// feeds the alignment check then).
int64_t row_stride(const at::Tensor& x, const char* op) {
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

// out: [..., d], input: [..., 2 * d].
void act_and_mul(at::Tensor& out, const at::Tensor& input, pyorch::Activation act,
                 const char* op) {
  TORCH_CHECK(out.is_cuda() && input.is_cuda() && out.device() == input.device(), op,
              ": tensors must be on the same CUDA device");
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
  TORCH_CHECK((input.size(-1) <= 1 || input.stride(-1) == 1) && (d <= 1 || out.stride(-1) == 1),
              op, ": the last dimension must be contiguous");
  const int64_t num_tokens = d == 0 ? 0 : out.numel() / d;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::act_and_mul(out.data_ptr(), input.const_data_ptr(), act,
                                        pyorch::to_pyorch_dtype(dtype), num_tokens, d,
                                        row_stride(out, op), row_stride(input, op),
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
