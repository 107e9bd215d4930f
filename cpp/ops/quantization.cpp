// CUDA adapters of the quantization ops: check (cpp/quantization_checks.h, shared with the CPU
// kernels), guard, stream, call cuda/, check status. Scales stay on the device (no host reads),
// so the ops can be captured in CUDA graphs.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "act_quant.h"
#include "common.h"
#include "norm_quant.h"
#include "ops.h"
#include "pyorch/quantization.h"
#include "quantization_checks.h"
#include "quantization_ops.h"

namespace {

void check_cuda(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": tensors must be on a CUDA device, got ", t.device());
}

pyorch::DType input_dtype(const at::Tensor& input) {
  return pyorch::to_pyorch_dtype(input.scalar_type());
}

}  // namespace

void static_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  check_cuda(input, "static_scaled_fp8_quant");
  const pyorch::QuantRows r = pyorch::check_static_scaled_fp8_quant(out, input, scale);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::static_scaled_fp8_quant(
      out.data_ptr(), input.const_data_ptr(), scale.const_data_ptr<float>(), input_dtype(input),
      r.num_tokens, r.hidden, r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}

void dynamic_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scale) {
  check_cuda(input, "dynamic_scaled_fp8_quant");
  const pyorch::QuantRows r = pyorch::check_dynamic_scaled_fp8_quant(out, input, scale);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::dynamic_scaled_fp8_quant(
      out.data_ptr(), input.const_data_ptr(), scale.data_ptr<float>(), input_dtype(input),
      r.num_tokens, r.hidden, r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}

void dynamic_per_token_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input,
                                        at::Tensor& scales,
                                        const std::optional<at::Tensor>& scale_ub) {
  check_cuda(input, "dynamic_per_token_scaled_fp8_quant");
  const pyorch::QuantRows r =
      pyorch::check_dynamic_per_token_scaled_fp8_quant(out, input, scales, scale_ub);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::dynamic_per_token_scaled_fp8_quant(
      out.data_ptr(), input.const_data_ptr(), scales.data_ptr<float>(),
      scale_ub ? scale_ub->const_data_ptr<float>() : nullptr, input_dtype(input), r.num_tokens,
      r.hidden, r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}

void static_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale,
                              const std::optional<at::Tensor>& azp) {
  check_cuda(input, "static_scaled_int8_quant");
  const pyorch::QuantRows r = pyorch::check_static_scaled_int8_quant(out, input, scale, azp);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::static_scaled_int8_quant(
      out.data_ptr<int8_t>(), input.const_data_ptr(), scale.const_data_ptr<float>(),
      azp ? azp->const_data_ptr<int32_t>() : nullptr, input_dtype(input), r.num_tokens, r.hidden,
      r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}

void dynamic_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scales,
                               std::optional<at::Tensor> azp) {
  check_cuda(input, "dynamic_scaled_int8_quant");
  const pyorch::QuantRows r = pyorch::check_dynamic_scaled_int8_quant(out, input, scales, azp);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::dynamic_scaled_int8_quant(
      out.data_ptr<int8_t>(), input.const_data_ptr(), scales.data_ptr<float>(),
      azp ? azp->data_ptr<int32_t>() : nullptr, input_dtype(input), r.num_tokens, r.hidden,
      r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q, at::Tensor& output_s,
                               int64_t group_size, double eps, double fp8_min, double fp8_max,
                               bool scale_ue8m0) {
  check_cuda(input, "per_token_group_fp8_quant");
  const pyorch::GroupQuantShape g = pyorch::check_per_token_group_fp8_quant(
      input, output_q, output_s, group_size, eps, fp8_min, fp8_max);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::per_token_group_fp8_quant(
      output_q.data_ptr(), input.const_data_ptr(), output_s.data_ptr<float>(), input_dtype(input),
      g.num_tokens, g.hidden, group_size, g.out_stride, g.in_stride, g.s_token_stride,
      g.s_group_stride, static_cast<float>(eps), static_cast<float>(fp8_min),
      static_cast<float>(fp8_max), scale_ue8m0, c10::cuda::getCurrentCUDAStream()));
}

namespace {

// The CUDA ops that the fused quantizations compose (cpp/norm_quant.h, cpp/act_quant.h) where
// their kernels do not take the rows.
struct CudaComposedOps {
  static void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       double eps) {
    ::rms_norm(out, input, weight, eps);
  }
  static void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                                 double eps) {
    ::fused_add_rms_norm(input, residual, weight, eps);
  }
  static void dynamic_per_token_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input,
                                                 at::Tensor& scales,
                                                 const std::optional<at::Tensor>& scale_ub) {
    ::dynamic_per_token_scaled_fp8_quant(out, input, scales, scale_ub);
  }
  static void silu_and_mul(at::Tensor& out, const at::Tensor& input) { ::silu_and_mul(out, input); }
};

}  // namespace

// One kernel for rows it takes (rms_norm_dynamic_per_token_fp8_quant_supported), else the two
// ops in turn (cpp/norm_quant.h): the same bits either way.
void rms_norm_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,
                                      const at::Tensor& weight, at::Tensor& scale, double epsilon,
                                      const std::optional<at::Tensor>& scale_ub,
                                      std::optional<at::Tensor> residual) {
  check_cuda(input, "rms_norm_dynamic_per_token_quant");
  const pyorch::QuantRows r = pyorch::check_rms_norm_dynamic_per_token_quant(
      result, input, weight, scale, scale_ub, residual);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  void* res = residual ? residual->data_ptr() : nullptr;
  const int64_t res_stride =
      residual ? pyorch::quant_row_stride(*residual, "rms_norm_dynamic_per_token_quant", "residual")
               : 0;
  if (!pyorch::rms_norm_dynamic_per_token_fp8_quant_supported(
          input_dtype(input), r.hidden, result.data_ptr(), input.const_data_ptr(), res,
          weight.const_data_ptr(), r.out_stride, r.in_stride, res_stride)) {
    pyorch::rms_norm_dynamic_per_token_quant_composed<CudaComposedOps>(result, input, weight, scale,
                                                                       epsilon, scale_ub, residual);
    return;
  }
  PYORCH_CHECK_CUDA(pyorch::rms_norm_dynamic_per_token_fp8_quant(
      result.data_ptr(), scale.data_ptr<float>(), input.const_data_ptr(), res,
      weight.const_data_ptr(), scale_ub ? scale_ub->const_data_ptr<float>() : nullptr,
      input_dtype(input), r.num_tokens, r.hidden, r.out_stride, r.in_stride, res_stride,
      static_cast<float>(epsilon), c10::cuda::getCurrentCUDAStream()));
}

// One kernel for rows it takes (silu_and_mul_dynamic_per_token_fp8_quant_supported), else
// silu_and_mul and the quantization in turn (cpp/act_quant.h): the same bits either way.
void silu_and_mul_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,
                                          at::Tensor& scale,
                                          const std::optional<at::Tensor>& scale_ub) {
  check_cuda(input, "silu_and_mul_dynamic_per_token_quant");
  const pyorch::QuantRows r =
      pyorch::check_silu_and_mul_dynamic_per_token_quant(result, input, scale, scale_ub);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  if (!pyorch::silu_and_mul_dynamic_per_token_fp8_quant_supported(
          input_dtype(input), r.hidden, result.data_ptr(), input.const_data_ptr(), r.out_stride,
          r.in_stride)) {
    pyorch::silu_and_mul_dynamic_per_token_quant_composed<CudaComposedOps>(result, input, scale,
                                                                           scale_ub);
    return;
  }
  PYORCH_CHECK_CUDA(pyorch::silu_and_mul_dynamic_per_token_fp8_quant(
      result.data_ptr(), scale.data_ptr<float>(), input.const_data_ptr(),
      scale_ub ? scale_ub->const_data_ptr<float>() : nullptr, input_dtype(input), r.num_tokens,
      r.hidden, r.out_stride, r.in_stride, c10::cuda::getCurrentCUDAStream()));
}
