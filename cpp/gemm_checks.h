// Argument checks shared by the CPU kernels (cpp/cpu/gemm.cpp) and the CUDA adapters
// (cpp/ops/gemm.cpp) of skinny_gemm and skinny_gemm_fused, so both backends accept and reject the
// same inputs.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

// The most rows skinny_gemm takes; equals kSkinnyGemmMaxTokens of the CUDA API (the adapter
// static_asserts it), restated here because the CPU build has no CUDA headers.
inline constexpr int64_t kSkinnyGemmMaxRows = 16;

// The sizes of a checked skinny_gemm call: out [num_tokens, output_size] = input [num_tokens,
// input_size] @ weight [output_size, input_size]^T, with element row strides.
struct SkinnyGemmShape {
  int64_t num_tokens;
  int64_t output_size;
  int64_t input_size;
  int64_t out_stride;
  int64_t input_stride;
};

inline bool skinny_aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// skinny_gemm_fused's epilogues; the values of the CUDA API's SkinnyGemmEpilogue (the adapter
// static_asserts them).
enum class SkinnyFusedEpilogue : int64_t { kStore = 0, kSiluMul = 1, kAdd = 2 };

// out_columns: the columns out must have (output_size, or output_size / 2 for SiLU-and-mul).
// weight_dtype: the weight's dtype when it is not input's (skinny_gemm_fp8: float8_e4m3fn).
inline SkinnyGemmShape check_skinny_gemm(const at::Tensor& out, const at::Tensor& input,
                                         const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         int64_t out_divisor = 1,
                                         std::optional<at::ScalarType> weight_dtype = {}) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "skinny_gemm: dtype must be float16 or bfloat16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == weight_dtype.value_or(dtype) && out.scalar_type() == dtype &&
                  (!bias || bias->scalar_type() == dtype),
              "skinny_gemm: out and bias dtypes must match input's ", dtype, " and weight's be ",
              weight_dtype.value_or(dtype), ", got weight ", weight.scalar_type());
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && out.dim() == 2,
              "skinny_gemm: input [num_tokens, input_size], weight [output_size, input_size] and "
              "out [num_tokens, output_size] must be 2-D, got ",
              input.sizes(), ", ", weight.sizes(), ", ", out.sizes());
  // The row stride of a single row, or of empty rows, means nothing (and may be anything): use
  // the natural one.
  const int64_t num_tokens = input.size(0);
  const bool one_in_row = num_tokens <= 1 || input.size(1) == 0;
  const int64_t out_columns = weight.size(0) / out_divisor;
  const bool one_out_row = num_tokens <= 1 || out_columns == 0;
  const SkinnyGemmShape s{num_tokens, weight.size(0), input.size(1),
                          one_out_row ? out_columns : out.stride(0),
                          one_in_row ? input.size(1) : input.stride(0)};
  TORCH_CHECK(weight.size(1) == s.input_size, "skinny_gemm: weight ", weight.sizes(),
              " does not match input ", input.sizes());
  TORCH_CHECK(out.size(0) == s.num_tokens && out.size(1) == out_columns, "skinny_gemm: out ",
              out.sizes(), " must be [", s.num_tokens, ", ", out_columns, "]");
  TORCH_CHECK(
      !bias || (bias->dim() == 1 && bias->size(0) == s.output_size && bias->is_contiguous()),
      "skinny_gemm: bias must be [", s.output_size, "] and contiguous");
  TORCH_CHECK(s.num_tokens <= kSkinnyGemmMaxRows, "skinny_gemm: num_tokens ", s.num_tokens,
              " is above the maximum ", kSkinnyGemmMaxRows, " (use F.linear)");
  TORCH_CHECK(s.input_size % 8 == 0, "skinny_gemm: input_size ", s.input_size,
              " must be a multiple of 8");
  TORCH_CHECK(weight.is_contiguous(), "skinny_gemm: weight must be contiguous");
  TORCH_CHECK(
      (s.input_size <= 1 || input.stride(1) == 1) && (out_columns <= 1 || out.stride(1) == 1),
      "skinny_gemm: the last dimension of input and out must be contiguous");
  TORCH_CHECK(s.input_stride % 8 == 0, "skinny_gemm: input row stride ", s.input_stride,
              " must be a multiple of 8");
  TORCH_CHECK(skinny_aligned16(input) && skinny_aligned16(weight),
              "skinny_gemm: input and weight must be 16-byte aligned");
  return s;
}

// skinny_gemm_fused: the checks of skinny_gemm (with out [num_tokens, output_size / 2] for
// SiLU-and-mul), plus the norm weight and the epilogue.
inline SkinnyGemmShape check_skinny_gemm_fused(const at::Tensor& out, const at::Tensor& input,
                                               const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               const std::optional<at::Tensor>& norm_weight,
                                               int64_t epilogue,
                                               std::optional<at::ScalarType> weight_dtype = {}) {
  TORCH_CHECK(epilogue >= 0 && epilogue <= 2, "skinny_gemm_fused: epilogue ", epilogue,
              " is not 0 (store), 1 (silu_and_mul) or 2 (add)");
  const auto epi = static_cast<SkinnyFusedEpilogue>(epilogue);
  TORCH_CHECK(!(norm_weight && epi == SkinnyFusedEpilogue::kAdd),
              "skinny_gemm_fused: the add epilogue takes no norm_weight");
  TORCH_CHECK(epi != SkinnyFusedEpilogue::kSiluMul || weight.dim() != 2 || weight.size(0) % 2 == 0,
              "skinny_gemm_fused: silu_and_mul needs an even number of weight rows [gate; up], "
              "got ",
              weight.sizes());
  const SkinnyGemmShape s = check_skinny_gemm(
      out, input, weight, bias, epi == SkinnyFusedEpilogue::kSiluMul ? 2 : 1, weight_dtype);
  if (norm_weight) {
    TORCH_CHECK(norm_weight->scalar_type() == input.scalar_type(),
                "skinny_gemm_fused: norm_weight dtype ", norm_weight->scalar_type(),
                " must match input's ", input.scalar_type());
    TORCH_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == s.input_size &&
                    norm_weight->is_contiguous() && skinny_aligned16(*norm_weight),
                "skinny_gemm_fused: norm_weight must be [", s.input_size,
                "], contiguous and 16-byte aligned, got ", norm_weight->sizes());
    TORCH_CHECK(s.input_size > 0, "skinny_gemm_fused: a normed input needs input_size > 0");
  }
  if (epi == SkinnyFusedEpilogue::kAdd) {
    const auto* o = static_cast<const char*>(out.const_data_ptr());
    const auto* x = static_cast<const char*>(input.const_data_ptr());
    const bool disjoint =
        out.numel() == 0 || input.numel() == 0 || o + out.nbytes() <= x || x + input.nbytes() <= o;
    TORCH_CHECK(disjoint, "skinny_gemm_fused: the add epilogue's out must not overlap input");
  }
  return s;
}

}  // namespace pyorch
