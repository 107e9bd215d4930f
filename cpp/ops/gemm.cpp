// CUDA adapters for skinny_gemm and skinny_gemm_fused: check, guard, stream, call cuda/, check
// status. No math here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "gemm_checks.h"
#include "ops.h"
#include "pyorch/gemm.h"

static_assert(pyorch::kSkinnyGemmMaxRows == pyorch::kSkinnyGemmMaxTokens,
              "the shared checks and the CUDA API disagree on skinny_gemm's row limit");
static_assert(static_cast<int>(pyorch::SkinnyFusedEpilogue::kStore) ==
                      static_cast<int>(pyorch::SkinnyGemmEpilogue::kStore) &&
                  static_cast<int>(pyorch::SkinnyFusedEpilogue::kSiluMul) ==
                      static_cast<int>(pyorch::SkinnyGemmEpilogue::kSiluMul) &&
                  static_cast<int>(pyorch::SkinnyFusedEpilogue::kAdd) ==
                      static_cast<int>(pyorch::SkinnyGemmEpilogue::kAdd),
              "the shared checks and the CUDA API disagree on skinny_gemm_fused's epilogues");

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

void skinny_gemm_fused(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& norm_weight, double epsilon,
                       int64_t epilogue, std::optional<bool> pdl) {
  TORCH_CHECK(input.is_cuda() && weight.device() == input.device() &&
                  out.device() == input.device() && (!bias || bias->device() == input.device()) &&
                  (!norm_weight || norm_weight->device() == input.device()),
              "skinny_gemm_fused: tensors must be on the same CUDA device");
  const pyorch::SkinnyGemmShape s =
      pyorch::check_skinny_gemm_fused(out, input, weight, bias, norm_weight, epilogue);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  pyorch::SkinnyGemmConfig config;  // all "launcher picks", but PDL when asked
  if (pdl) config.pdl = *pdl ? 1 : 0;
  PYORCH_CHECK_CUDA(pyorch::skinny_gemm_fused(
      out.data_ptr(), input.const_data_ptr(), weight.const_data_ptr(),
      bias ? bias->const_data_ptr() : nullptr,
      norm_weight ? norm_weight->const_data_ptr() : nullptr, static_cast<float>(epsilon),
      static_cast<pyorch::SkinnyGemmEpilogue>(epilogue),
      pyorch::to_pyorch_dtype(input.scalar_type()), s.num_tokens, s.output_size, s.input_size,
      s.out_stride, s.input_stride, c10::cuda::getCurrentCUDAStream(), &config));
}
