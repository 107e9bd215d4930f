// Argument checks shared by the CPU kernel (cpp/cpu/gemm.cpp) and the CUDA adapter
// (cpp/ops/gemm.cpp) of skinny_gemm, so both backends accept and reject the same inputs.
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

inline SkinnyGemmShape check_skinny_gemm(const at::Tensor& out, const at::Tensor& input,
                                         const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "skinny_gemm: dtype must be float16 or bfloat16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype && out.scalar_type() == dtype &&
                  (!bias || bias->scalar_type() == dtype),
              "skinny_gemm: out, weight and bias dtypes must match input's ", dtype);
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && out.dim() == 2,
              "skinny_gemm: input [num_tokens, input_size], weight [output_size, input_size] and "
              "out [num_tokens, output_size] must be 2-D, got ",
              input.sizes(), ", ", weight.sizes(), ", ", out.sizes());
  // The row stride of a single row, or of empty rows, means nothing (and may be anything): use
  // the natural one.
  const int64_t num_tokens = input.size(0);
  const bool one_in_row = num_tokens <= 1 || input.size(1) == 0;
  const bool one_out_row = num_tokens <= 1 || weight.size(0) == 0;
  const SkinnyGemmShape s{num_tokens, weight.size(0), input.size(1),
                          one_out_row ? weight.size(0) : out.stride(0),
                          one_in_row ? input.size(1) : input.stride(0)};
  TORCH_CHECK(weight.size(1) == s.input_size, "skinny_gemm: weight ", weight.sizes(),
              " does not match input ", input.sizes());
  TORCH_CHECK(out.size(0) == s.num_tokens && out.size(1) == s.output_size, "skinny_gemm: out ",
              out.sizes(), " must be [", s.num_tokens, ", ", s.output_size, "]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == s.output_size &&
                        bias->is_contiguous()),
              "skinny_gemm: bias must be [", s.output_size, "] and contiguous");
  TORCH_CHECK(s.num_tokens <= kSkinnyGemmMaxRows, "skinny_gemm: num_tokens ", s.num_tokens,
              " is above the maximum ", kSkinnyGemmMaxRows, " (use F.linear)");
  TORCH_CHECK(s.input_size % 8 == 0, "skinny_gemm: input_size ", s.input_size,
              " must be a multiple of 8");
  TORCH_CHECK(weight.is_contiguous(), "skinny_gemm: weight must be contiguous");
  TORCH_CHECK((s.input_size <= 1 || input.stride(1) == 1) &&
                  (s.output_size <= 1 || out.stride(1) == 1),
              "skinny_gemm: the last dimension of input and out must be contiguous");
  TORCH_CHECK(s.input_stride % 8 == 0, "skinny_gemm: input row stride ",
              s.input_stride, " must be a multiple of 8");
  TORCH_CHECK(skinny_aligned16(input) && skinny_aligned16(weight),
              "skinny_gemm: input and weight must be 16-byte aligned");
  return s;
}

}  // namespace pyorch
