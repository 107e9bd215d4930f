// CUDA adapter for skinny_gemm_fp8: check, guard, stream, call cuda/, check status. No math here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "gemm_fp8_checks.h"
#include "pyorch/gemm.h"

void skinny_gemm_fp8(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& norm_weight, double epsilon, int64_t epilogue,
                     std::optional<bool> pdl) {
  TORCH_CHECK(input.is_cuda() && weight.device() == input.device() &&
                  out.device() == input.device() && weight_scale.device() == input.device() &&
                  (!bias || bias->device() == input.device()) &&
                  (!norm_weight || norm_weight->device() == input.device()),
              "skinny_gemm_fp8: tensors must be on the same CUDA device");
  bool per_channel = false;
  const pyorch::SkinnyGemmShape s = pyorch::check_skinny_gemm_fp8(
      out, input, weight, weight_scale, bias, norm_weight, epilogue, &per_channel);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  pyorch::SkinnyGemmConfig config;  // all "launcher picks", but PDL when asked
  if (pdl) config.pdl = *pdl ? 1 : 0;
  PYORCH_CHECK_CUDA(pyorch::skinny_gemm_fp8(
      out.data_ptr(), input.const_data_ptr(), weight.const_data_ptr(),
      weight_scale.const_data_ptr<float>(), per_channel, bias ? bias->const_data_ptr() : nullptr,
      norm_weight ? norm_weight->const_data_ptr() : nullptr, static_cast<float>(epsilon),
      static_cast<pyorch::SkinnyGemmEpilogue>(epilogue),
      pyorch::to_pyorch_dtype(input.scalar_type()), s.num_tokens, s.output_size, s.input_size,
      s.out_stride, s.input_stride, c10::cuda::getCurrentCUDAStream(), &config));
}
