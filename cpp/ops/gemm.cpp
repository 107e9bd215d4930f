// CUDA adapter for skinny_gemm: check, guard, stream, call cuda/, check status. No math here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "gemm_checks.h"
#include "ops.h"
#include "pyorch/gemm.h"

static_assert(pyorch::kSkinnyGemmMaxRows == pyorch::kSkinnyGemmMaxTokens,
              "the shared checks and the CUDA API disagree on skinny_gemm's row limit");

void skinny_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.is_cuda() && weight.device() == input.device() &&
                  out.device() == input.device() && (!bias || bias->device() == input.device()),
              "skinny_gemm: tensors must be on the same CUDA device");
  const pyorch::SkinnyGemmShape s = pyorch::check_skinny_gemm(out, input, weight, bias);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::skinny_gemm(
      out.data_ptr(), input.const_data_ptr(), weight.const_data_ptr(),
      bias ? bias->const_data_ptr() : nullptr, pyorch::to_pyorch_dtype(input.scalar_type()),
      s.num_tokens, s.output_size, s.input_size, s.out_stride, s.input_stride,
      c10::cuda::getCurrentCUDAStream()));
}
