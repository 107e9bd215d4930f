// Prototypes of the quantization ops (kept out of ops.h so that adding them recompiles only the
// files that use them). CPU kernels: cpp/cpu/quantization.cpp (namespace pyorch::cpu); CUDA
// adapters: cpp/ops/quantization.cpp (the quant ops) and the CUTLASS GEMM adapters (global
// namespace). Schemas and shapes: cpp/torch_bindings.cpp and cpp/quantization_checks.h.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

// scaled_fp8_quant's three forms, scaled_int8_quant's two, the 1 x group_size activation
// quantization of block-fp8 GEMMs, and RMSNorm / silu_and_mul fused with the per-token fp8
// quantization.
#define PYORCH_DECLARE_QUANT_OPS                                                                   \
  void static_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale); \
  void dynamic_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scale);      \
  void dynamic_per_token_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input,                \
                                          at::Tensor& scales,                                      \
                                          const std::optional<at::Tensor>& scale_ub);              \
  void static_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale, \
                                const std::optional<at::Tensor>& azp);                             \
  void dynamic_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scales,     \
                                 std::optional<at::Tensor> azp);                                   \
  void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q,                    \
                                 at::Tensor& output_s, int64_t group_size, double eps,             \
                                 double fp8_min, double fp8_max, bool scale_ue8m0);                \
  void rms_norm_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,               \
                                        const at::Tensor& weight, at::Tensor& scale,               \
                                        double epsilon, const std::optional<at::Tensor>& scale_ub, \
                                        std::optional<at::Tensor> residual);                       \
  void silu_and_mul_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,           \
                                            at::Tensor& scale,                                     \
                                            const std::optional<at::Tensor>& scale_ub);

// The scaled GEMMs (CUDA: CUTLASS, in the wt-fp8gemm adapters).
#define PYORCH_DECLARE_SCALED_MM_OPS                                                          \
  void cutlass_scaled_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,           \
                         const at::Tensor& a_scales, const at::Tensor& b_scales,              \
                         const std::optional<at::Tensor>& bias);                              \
  void cutlass_scaled_mm_azp(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,       \
                             const at::Tensor& a_scales, const at::Tensor& b_scales,          \
                             const at::Tensor& azp_adj, const std::optional<at::Tensor>& azp, \
                             const std::optional<at::Tensor>& bias);

// CUDA adapters.
PYORCH_DECLARE_QUANT_OPS
PYORCH_DECLARE_SCALED_MM_OPS

// CPU kernels.
namespace pyorch::cpu {
PYORCH_DECLARE_QUANT_OPS
PYORCH_DECLARE_SCALED_MM_OPS
}  // namespace pyorch::cpu
