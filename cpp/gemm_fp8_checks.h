// skinny_gemm_fp8 (the decode GEMM of fp8 weights): its argument checks, shared by the CPU kernel
// (cpp/cpu/gemm_fp8.cpp) and the CUDA adapter (cpp/ops/gemm_fp8.cpp), and both prototypes.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "gemm_checks.h"

namespace pyorch {

// skinny_gemm_fused's checks with a float8_e4m3fn weight, plus its scale: float32, contiguous,
// [1] (per tensor) or [output_size] (per output channel). input_size a multiple of 16 (one
// 16-byte load of e4m3 weight). Returns the shape; per_channel says which scale it is.
inline SkinnyGemmShape check_skinny_gemm_fp8(const at::Tensor& out, const at::Tensor& input,
                                             const at::Tensor& weight,
                                             const at::Tensor& weight_scale,
                                             const std::optional<at::Tensor>& bias,
                                             const std::optional<at::Tensor>& norm_weight,
                                             int64_t epilogue, bool* per_channel) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn,
              "skinny_gemm_fp8: weight must be float8_e4m3fn, got ", weight.scalar_type());
  const SkinnyGemmShape s =
      check_skinny_gemm_fused(out, input, weight, bias, norm_weight, epilogue, at::kFloat8_e4m3fn);
  TORCH_CHECK(s.input_size % 16 == 0, "skinny_gemm_fp8: input_size ", s.input_size,
              " must be a multiple of 16");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.dim() <= 1 &&
                  (weight_scale.numel() == 1 || weight_scale.numel() == s.output_size),
              "skinny_gemm_fp8: weight_scale must be float32 [1] or [", s.output_size,
              "] and contiguous, got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
  *per_channel = weight_scale.numel() != 1 || s.output_size == 1;
  return s;
}

}  // namespace pyorch

// CUDA adapter (cpp/ops/gemm_fp8.cpp) and CPU kernel (cpp/cpu/gemm_fp8.cpp).
#define PYORCH_DECLARE_GEMM_FP8_OPS                                                           \
  void skinny_gemm_fp8(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,    \
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, \
                       const std::optional<at::Tensor>& norm_weight, double epsilon,          \
                       int64_t epilogue, std::optional<bool> pdl);
PYORCH_DECLARE_GEMM_FP8_OPS
namespace pyorch::cpu {
PYORCH_DECLARE_GEMM_FP8_OPS
}  // namespace pyorch::cpu
