// Argument checks shared by the CPU kernels (cpp/cpu/quantization.cpp) and the CUDA adapters
// (cpp/ops/quantization.cpp, and the CUTLASS GEMM adapters) of the quantization ops, so both
// backends accept and reject the same inputs. Shapes follow vLLM's _custom_ops:
//   scaled_fp8_quant / scaled_int8_quant: input [num_tokens, hidden] -> out [num_tokens, hidden]
//   per_token_group_fp8_quant: input [M, K] -> output_q [M, K], output_s [M, K / group_size]
//   cutlass_scaled_mm: out [M, N] = (a [M, K] @ b [K, N]) * scales (+ bias [N]); b column-major
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

// The largest finite float8_e4m3fn (S.1111.110 = 1.75 * 2^8).
inline constexpr float kFp8E4m3Max = 448.f;
// The smallest dynamic per-token scale: 1 / (448 * 512), as vLLM, so an all-zero row quantizes
// to zeros instead of dividing by zero.
inline constexpr float kFp8MinScalingFactor = 1.f / (kFp8E4m3Max * 512.f);
// The block size of block-scaled GEMMs: weights in 128 x 128 blocks, activations in 1 x 128
// groups (DeepSeek-V3 / Qwen3-FP8 checkpoints).
inline constexpr int64_t kScaledMmBlock = 128;

inline bool quant_is_float_input(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A quant op's rows: input and out viewed as [num_tokens, hidden], element row strides.
struct QuantRows {
  int64_t num_tokens;
  int64_t hidden;
  int64_t in_stride;
  int64_t out_stride;
};

// Row stride of x viewed as [rows, hidden]: the last dim contiguous, the leading dims collapsible.
inline int64_t quant_row_stride(const at::Tensor& x, const char* op, const char* what) {
  TORCH_CHECK(x.dim() >= 1, op, ": ", what, " must have at least one dimension");
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, op, ": the last dimension of ", what,
              " must be contiguous");
  if (x.dim() == 1) return x.size(0);
  for (int64_t d = 0; d + 2 < x.dim(); ++d) {
    TORCH_CHECK(x.size(d + 1) <= 1 || x.stride(d) == x.stride(d + 1) * x.size(d + 1), op, ": ",
                what, "'s leading dimensions must collapse into rows");
  }
  return x.size(-2) <= 1 ? x.size(-1) : x.stride(-2);
}

// out (out_dtype) and input (fp32/fp16/bf16) of the same shape; the out rows may be more than the
// input's (vLLM's num_token_padding: only the input's rows are written).
inline QuantRows check_quant_rows(const at::Tensor& out, const at::Tensor& input,
                                  at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK(quant_is_float_input(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(out.scalar_type() == out_dtype, op, ": out dtype must be ", out_dtype, ", got ",
              out.scalar_type());
  TORCH_CHECK(input.dim() >= 1 && out.dim() == input.dim(), op, ": out ", out.sizes(),
              " and input ", input.sizes(), " must have the same number of dimensions");
  TORCH_CHECK(out.size(-1) == input.size(-1), op, ": out ", out.sizes(), " must match input ",
              input.sizes(), " in the last dimension");
  const int64_t hidden = input.size(-1);
  const int64_t num_tokens = hidden == 0 ? 0 : input.numel() / hidden;
  const int64_t out_tokens = hidden == 0 ? 0 : out.numel() / hidden;
  TORCH_CHECK(out_tokens >= num_tokens && (input.dim() == 2 || out.sizes() == input.sizes()), op,
              ": out ", out.sizes(), " must have input's shape ", input.sizes(),
              " (a 2-D out may have extra rows)");
  return QuantRows{num_tokens, hidden, quant_row_stride(input, op, "input"),
                   quant_row_stride(out, op, "out")};
}

inline void check_float_scalar(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": ", what,
              " must be one float32 value, got ", t.scalar_type(), " ", t.sizes());
}

// A per-token vector ([num_tokens] or [num_tokens, 1], contiguous) of dtype.
inline void check_per_token(const at::Tensor& t, int64_t num_tokens, at::ScalarType dtype,
                            const char* op, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", what, " dtype must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == num_tokens && t.is_contiguous(), op, ": ", what,
              " must be contiguous with one value per token (", num_tokens, "), got ", t.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device() == b.device(), op, ": tensors on different devices: ", a.device(), " and ",
              b.device());
}

inline QuantRows check_static_scaled_fp8_quant(const at::Tensor& out, const at::Tensor& input,
                                               const at::Tensor& scale) {
  const char* op = "static_scaled_fp8_quant";
  check_float_scalar(scale, op, "scale");
  check_same_device(out, input, op);
  check_same_device(scale, input, op);
  return check_quant_rows(out, input, at::kFloat8_e4m3fn, op);
}

inline QuantRows check_dynamic_scaled_fp8_quant(const at::Tensor& out, const at::Tensor& input,
                                                const at::Tensor& scale) {
  const char* op = "dynamic_scaled_fp8_quant";
  check_float_scalar(scale, op, "scale");
  check_same_device(out, input, op);
  check_same_device(scale, input, op);
  return check_quant_rows(out, input, at::kFloat8_e4m3fn, op);
}

inline QuantRows check_dynamic_per_token_scaled_fp8_quant(
    const at::Tensor& out, const at::Tensor& input, const at::Tensor& scales,
    const std::optional<at::Tensor>& scale_ub) {
  const char* op = "dynamic_per_token_scaled_fp8_quant";
  const QuantRows r = check_quant_rows(out, input, at::kFloat8_e4m3fn, op);
  check_per_token(scales, r.num_tokens, at::kFloat, op, "scales");
  check_same_device(out, input, op);
  check_same_device(scales, input, op);
  if (scale_ub) {
    check_float_scalar(*scale_ub, op, "scale_ub");
    check_same_device(*scale_ub, input, op);
  }
  return r;
}

// rms_norm_dynamic_per_token_quant: result fp8 (int8 is refused: pyorch quantizes int8
// activations with dynamic_scaled_int8_quant), input [num_tokens, hidden], weight [hidden] and
// residual (input's shape) of input's dtype, scales one float32 per token, scale_ub one float32.
inline QuantRows check_rms_norm_dynamic_per_token_quant(const at::Tensor& result,
                                                        const at::Tensor& input,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& scales,
                                                        const std::optional<at::Tensor>& scale_ub,
                                                        const std::optional<at::Tensor>& residual) {
  const char* op = "rms_norm_dynamic_per_token_quant";
  TORCH_CHECK(result.scalar_type() != at::kChar, op,
              ": an int8 result is not supported (quantize int8 activations with "
              "dynamic_scaled_int8_quant); result must be float8_e4m3fn");
  const QuantRows r = check_quant_rows(result, input, at::kFloat8_e4m3fn, op);
  TORCH_CHECK(result.sizes() == input.sizes(), op, ": result ", result.sizes(),
              " must have input's shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == r.hidden && weight.is_contiguous(), op,
              ": weight must be contiguous [", r.hidden, "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype ",
              weight.scalar_type(), " must be input's ", input.scalar_type());
  check_per_token(scales, r.num_tokens, at::kFloat, op, "scale");
  check_same_device(result, input, op);
  check_same_device(weight, input, op);
  check_same_device(scales, input, op);
  if (scale_ub) {
    check_float_scalar(*scale_ub, op, "scale_ub");
    check_same_device(*scale_ub, input, op);
  }
  if (residual) {
    TORCH_CHECK(
        residual->sizes() == input.sizes() && residual->scalar_type() == input.scalar_type(), op,
        ": residual (", residual->scalar_type(), " ", residual->sizes(), ") must match input (",
        input.scalar_type(), " ", input.sizes(), ")");
    check_same_device(*residual, input, op);
    quant_row_stride(*residual, op, "residual");
  }
  return r;
}

// silu_and_mul_dynamic_per_token_quant: input [..., 2 * d] (gate then up; fp32, fp16 or bf16),
// result [..., d] fp8 (int8 refused, as above), scale one float32 per row, scale_ub one float32.
// The returned rows' hidden is d.
inline QuantRows check_silu_and_mul_dynamic_per_token_quant(
    const at::Tensor& result, const at::Tensor& input, const at::Tensor& scale,
    const std::optional<at::Tensor>& scale_ub) {
  const char* op = "silu_and_mul_dynamic_per_token_quant";
  TORCH_CHECK(result.scalar_type() != at::kChar, op,
              ": an int8 result is not supported (quantize int8 activations with "
              "dynamic_scaled_int8_quant); result must be float8_e4m3fn");
  TORCH_CHECK(result.scalar_type() == at::kFloat8_e4m3fn, op,
              ": result dtype must be Float8_e4m3fn, got ", result.scalar_type());
  TORCH_CHECK(quant_is_float_input(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) > 0 && input.size(-1) % 2 == 0, op,
              ": the last dimension of input (gate then up) must be even and positive, got ",
              input.sizes());
  const int64_t d = input.size(-1) / 2;
  TORCH_CHECK(
      result.dim() == input.dim() && result.size(-1) == d &&
          result.sizes().slice(0, result.dim() - 1) == input.sizes().slice(0, input.dim() - 1),
      op, ": result must be input's shape with the last dimension halved, got result ",
      result.sizes(), " for input ", input.sizes());
  const int64_t num_tokens = input.numel() / input.size(-1);
  check_per_token(scale, num_tokens, at::kFloat, op, "scale");
  check_same_device(result, input, op);
  check_same_device(scale, input, op);
  if (scale_ub) {
    check_float_scalar(*scale_ub, op, "scale_ub");
    check_same_device(*scale_ub, input, op);
  }
  return QuantRows{num_tokens, d, quant_row_stride(input, op, "input"),
                   quant_row_stride(result, op, "result")};
}

inline QuantRows check_static_scaled_int8_quant(const at::Tensor& out, const at::Tensor& input,
                                                const at::Tensor& scale,
                                                const std::optional<at::Tensor>& azp) {
  const char* op = "static_scaled_int8_quant";
  check_float_scalar(scale, op, "scale");
  check_same_device(out, input, op);
  check_same_device(scale, input, op);
  if (azp) {
    TORCH_CHECK(azp->scalar_type() == at::kInt && azp->numel() == 1, op,
                ": azp must be one int32 value, got ", azp->scalar_type(), " ", azp->sizes());
    check_same_device(*azp, input, op);
  }
  return check_quant_rows(out, input, at::kChar, op);
}

inline QuantRows check_dynamic_scaled_int8_quant(const at::Tensor& out, const at::Tensor& input,
                                                 const at::Tensor& scales,
                                                 const std::optional<at::Tensor>& azp) {
  const char* op = "dynamic_scaled_int8_quant";
  const QuantRows r = check_quant_rows(out, input, at::kChar, op);
  check_per_token(scales, r.num_tokens, at::kFloat, op, "scales");
  check_same_device(out, input, op);
  check_same_device(scales, input, op);
  if (azp) {
    check_per_token(*azp, r.num_tokens, at::kInt, op, "azp");
    check_same_device(*azp, input, op);
  }
  return r;
}

// per_token_group_fp8_quant: input [M, K] (K % group_size == 0), output_q [M, K] float8_e4m3fn,
// output_s [M, K / group_size] float32 with any strides (column-major for the block GEMM).
struct GroupQuantShape {
  int64_t num_tokens;
  int64_t hidden;
  int64_t num_groups;
  int64_t in_stride;
  int64_t out_stride;
  int64_t s_token_stride;
  int64_t s_group_stride;
};

inline GroupQuantShape check_per_token_group_fp8_quant(const at::Tensor& input,
                                                       const at::Tensor& output_q,
                                                       const at::Tensor& output_s,
                                                       int64_t group_size, double eps,
                                                       double fp8_min, double fp8_max) {
  const char* op = "per_token_group_fp8_quant";
  TORCH_CHECK(input.dim() == 2 && output_q.dim() == 2 && output_s.dim() == 2, op,
              ": input [M, K], output_q [M, K] and output_s [M, K / group_size] must be 2-D");
  TORCH_CHECK(group_size > 0, op, ": group_size must be positive, got ", group_size);
  TORCH_CHECK(input.size(1) % group_size == 0, op, ": K = ", input.size(1),
              " is not a multiple of group_size ", group_size);
  TORCH_CHECK(
      eps >= 0 && fp8_max > 0 && fp8_min < 0 && fp8_max <= kFp8E4m3Max && fp8_min >= -kFp8E4m3Max,
      op, ": need eps >= 0 and -448 <= fp8_min < 0 < fp8_max <= 448");
  const QuantRows r = check_quant_rows(output_q, input, at::kFloat8_e4m3fn, op);
  TORCH_CHECK(output_q.sizes() == input.sizes(), op, ": output_q ", output_q.sizes(),
              " must match input ", input.sizes());
  const int64_t num_groups = r.hidden / group_size;
  TORCH_CHECK(output_s.scalar_type() == at::kFloat && output_s.size(0) == r.num_tokens &&
                  output_s.size(1) == num_groups,
              op, ": output_s must be float32 [", r.num_tokens, ", ", num_groups, "], got ",
              output_s.scalar_type(), " ", output_s.sizes());
  check_same_device(output_q, input, op);
  check_same_device(output_s, input, op);
  return GroupQuantShape{r.num_tokens, r.hidden,           num_groups,        r.in_stride,
                         r.out_stride, output_s.stride(0), output_s.stride(1)};
}

// How cutlass_scaled_mm's scales apply (from their shapes, as vLLM dispatches).
enum class ScaledMmScales {
  kTensorOrChannel,  // a_scales numel 1 or M (per token), b_scales numel 1 or N (per channel)
  kBlock,            // a_scales [M, ceil(K/128)], b_scales [ceil(K/128), ceil(N/128)]
};

struct ScaledMmShape {
  int64_t m;
  int64_t n;
  int64_t k;
  ScaledMmScales scales;
  bool per_token_a;    // kTensorOrChannel: a_scales has M values (else one)
  bool per_channel_b;  // kTensorOrChannel: b_scales has N values (else one)
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out [M, N] = a [M, K] @ b [K, N]: a row-major, b column-major (b = weight.t() of a [N, K]
// weight), out row-major; fp8 x fp8 or int8 x int8; out bf16/fp16/fp32; bias [N] in out's dtype.
inline ScaledMmShape check_cutlass_scaled_mm(const at::Tensor& out, const at::Tensor& a,
                                             const at::Tensor& b, const at::Tensor& a_scales,
                                             const at::Tensor& b_scales,
                                             const std::optional<at::Tensor>& bias,
                                             const char* op = "cutlass_scaled_mm") {
  const at::ScalarType in = a.scalar_type();
  TORCH_CHECK(in == at::kFloat8_e4m3fn || in == at::kChar, op,
              ": a must be float8_e4m3fn or int8, got ", in);
  TORCH_CHECK(b.scalar_type() == in, op, ": b dtype ", b.scalar_type(), " must match a's ", in);
  const at::ScalarType od = out.scalar_type();
  TORCH_CHECK(od == at::kBFloat16 || od == at::kHalf || od == at::kFloat, op,
              ": out dtype must be bfloat16, float16 or float32, got ", od);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2, op,
              ": a [M, K], b [K, N] and out [M, N] must be 2-D");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK(b.size(0) == k && out.size(0) == m && out.size(1) == n, op, ": a ", a.sizes(), ", b ",
              b.sizes(), " and out ", out.sizes(), " do not match");
  TORCH_CHECK(k <= 1 || a.stride(1) == 1, op, ": a must be row-major (stride(1) == 1)");
  TORCH_CHECK(k <= 1 || b.stride(0) == 1, op,
              ": b must be column-major (stride(0) == 1, i.e. weight.t())");
  TORCH_CHECK(n <= 1 || out.stride(1) == 1, op, ": out must be row-major (stride(1) == 1)");
  TORCH_CHECK(a_scales.scalar_type() == at::kFloat && b_scales.scalar_type() == at::kFloat, op,
              ": a_scales and b_scales must be float32");
  for (const at::Tensor* t : {&b, &out, &a_scales, &b_scales}) check_same_device(a, *t, op);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == od && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(),
                op, ": bias must be contiguous [", n, "] of out's dtype ", od);
    check_same_device(a, *bias, op);
  }
  const bool a_std = a_scales.numel() == 1 || (a_scales.numel() == m && a_scales.is_contiguous());
  const bool b_std = b_scales.numel() == 1 || (b_scales.numel() == n && b_scales.is_contiguous());
  if (a_std && b_std) {
    return ScaledMmShape{m,
                         n,
                         k,
                         ScaledMmScales::kTensorOrChannel,
                         a_scales.numel() != 1 || m == 1,
                         b_scales.numel() != 1 || n == 1};
  }
  const int64_t kb = ceil_div(k, kScaledMmBlock), nb = ceil_div(n, kScaledMmBlock);
  const bool block = a_scales.dim() == 2 && a_scales.size(0) == m && a_scales.size(1) == kb &&
                     b_scales.dim() == 2 && b_scales.size(0) == kb && b_scales.size(1) == nb;
  TORCH_CHECK(block, op, ": scales must be per-tensor ([1]) or per-token ([M] = ", m,
              ") for a and per-tensor or per-channel ([N] = ", n, ") for b, or block-wise: a [", m,
              ", ", kb, "] and b [", kb, ", ", nb, "]; got a_scales ", a_scales.sizes(),
              " and b_scales ", b_scales.sizes());
  TORCH_CHECK(in == at::kFloat8_e4m3fn, op, ": block-wise scales need float8_e4m3fn inputs");
  return ScaledMmShape{m, n, k, ScaledMmScales::kBlock, true, true};
}

// cutlass_scaled_mm_azp: int8 only, per-tensor/per-token a_scales; azp_adj [N] int32 (per-tensor
// azp: azp * colsum(b); per-token azp: colsum(b), with azp [M] int32).
inline ScaledMmShape check_cutlass_scaled_mm_azp(const at::Tensor& out, const at::Tensor& a,
                                                 const at::Tensor& b, const at::Tensor& a_scales,
                                                 const at::Tensor& b_scales,
                                                 const at::Tensor& azp_adj,
                                                 const std::optional<at::Tensor>& azp,
                                                 const std::optional<at::Tensor>& bias) {
  const char* op = "cutlass_scaled_mm_azp";
  TORCH_CHECK(a.scalar_type() == at::kChar, op, ": a and b must be int8, got ", a.scalar_type());
  const ScaledMmShape s = check_cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias, op);
  TORCH_CHECK(s.scales == ScaledMmScales::kTensorOrChannel, op, ": block scales are fp8 only");
  TORCH_CHECK(
      azp_adj.scalar_type() == at::kInt && azp_adj.numel() == s.n && azp_adj.is_contiguous(), op,
      ": azp_adj must be contiguous int32 [", s.n, "], got ", azp_adj.scalar_type(), " ",
      azp_adj.sizes());
  check_same_device(a, azp_adj, op);
  if (azp) {
    TORCH_CHECK(azp->scalar_type() == at::kInt && azp->numel() == s.m && azp->is_contiguous(), op,
                ": azp must be contiguous int32 [", s.m, "] (per token), got ", azp->scalar_type(),
                " ", azp->sizes());
    TORCH_CHECK(a_scales.numel() == s.m, op, ": a per-token azp needs per-token a_scales");
    check_same_device(a, *azp, op);
  }
  return s;
}

}  // namespace pyorch
