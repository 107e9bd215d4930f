// CPU quantization ops: fp8 (e4m3) and int8 quantization of activations, and the scaled GEMMs
// that consume them. They round as the CUDA kernels do: values are divided by their scale in
// fp32 (correctly rounded, so a float64 reference that rounds once to fp32 agrees bit for bit),
// clamped to the format's range, then rounded to nearest even (fp8 through c10's conversion,
// int8 through nearbyint). The GEMMs accumulate fp8 products in fp32 and int8 products in int32
// (torch's CPU _int_mm), then apply the scales in fp32 and round once to out's dtype.
#include <algorithm>
#include <cmath>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Float8_e4m3fn.h>

#include "act_quant.h"
#include "cpu/cpu_utils.h"
#include "norm_quant.h"
#include "ops.h"
#include "quantization_checks.h"
#include "quantization_ops.h"

namespace pyorch::cpu {
namespace {

using Fp8 = c10::Float8_e4m3fn;

inline Fp8 to_fp8(float x, float lo = -kFp8E4m3Max, float hi = kFp8E4m3Max) {
  return Fp8(std::fmax(lo, std::fmin(x, hi)));
}

inline int8_t to_int8(float x) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(x), -128.f, 127.f));
}

inline int8_t int32_to_int8(int32_t x) {
  return static_cast<int8_t>(std::clamp(x, int32_t{-128}, int32_t{127}));
}

// Calls fn(row_in, row_out, token) for every row, rows split over threads.
template <typename T, typename Out, typename Fn>
void for_each_row(const QuantRows& r, const at::Tensor& input, at::Tensor& out, Fn fn) {
  const T* in = input.const_data_ptr<T>();
  Out* o = static_cast<Out*>(out.data_ptr());
  at::parallel_for(0, r.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(in + t * r.in_stride, o + t * r.out_stride, t);
  });
}

template <typename T>
float row_absmax(const T* x, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(static_cast<float>(x[i])));
  return m;
}

template <typename T>
void fp8_quant_rows(const QuantRows& r, const at::Tensor& input, at::Tensor& out, float scale) {
  for_each_row<T, Fp8>(r, input, out, [&](const T* x, Fp8* o, int64_t) {
    for (int64_t i = 0; i < r.hidden; ++i) o[i] = to_fp8(static_cast<float>(x[i]) / scale);
  });
}

}  // namespace

void static_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const QuantRows r = check_static_scaled_fp8_quant(out, input, scale);
  const float s = scale.item<float>();
  TORCH_CHECK(s > 0 && std::isfinite(s), "static_scaled_fp8_quant: scale must be positive, got ",
              s);
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "static_scaled_fp8_quant",
                             [&] { fp8_quant_rows<scalar_t>(r, input, out, s); });
}

void dynamic_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scale) {
  const QuantRows r = check_dynamic_scaled_fp8_quant(out, input, scale);
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "dynamic_scaled_fp8_quant", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    float absmax = 0.f;
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      absmax = std::fmax(absmax, row_absmax(in + t * r.in_stride, r.hidden));
    }
    const float s = std::fmax(absmax / kFp8E4m3Max, kFp8MinScalingFactor);
    scale.fill_(s);
    fp8_quant_rows<scalar_t>(r, input, out, s);
  });
}

void dynamic_per_token_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input,
                                        at::Tensor& scales,
                                        const std::optional<at::Tensor>& scale_ub) {
  const QuantRows r = check_dynamic_per_token_scaled_fp8_quant(out, input, scales, scale_ub);
  const float ub = scale_ub ? scale_ub->item<float>() : INFINITY;
  float* s = scales.data_ptr<float>();
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "dynamic_per_token_scaled_fp8_quant", [&] {
    for_each_row<scalar_t, Fp8>(r, input, out, [&](const scalar_t* x, Fp8* o, int64_t t) {
      const float absmax = std::fmin(row_absmax(x, r.hidden), ub);
      const float token_scale = std::fmax(absmax / kFp8E4m3Max, kFp8MinScalingFactor);
      s[t] = token_scale;
      for (int64_t i = 0; i < r.hidden; ++i) o[i] = to_fp8(static_cast<float>(x[i]) / token_scale);
    });
  });
}

void static_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale,
                              const std::optional<at::Tensor>& azp) {
  const QuantRows r = check_static_scaled_int8_quant(out, input, scale, azp);
  const float s = scale.item<float>();
  TORCH_CHECK(s > 0 && std::isfinite(s), "static_scaled_int8_quant: scale must be positive, got ",
              s);
  const int32_t zp = azp ? azp->item<int32_t>() : 0;
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "static_scaled_int8_quant", [&] {
    for_each_row<scalar_t, int8_t>(r, input, out, [&](const scalar_t* x, int8_t* o, int64_t) {
      for (int64_t i = 0; i < r.hidden; ++i) {
        const float q = std::nearbyint(static_cast<float>(x[i]) / s);
        o[i] =
            azp ? int32_to_int8(static_cast<int32_t>(std::clamp(q, -1e9f, 1e9f)) + zp) : to_int8(q);
      }
    });
  });
}

void dynamic_scaled_int8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scales,
                               std::optional<at::Tensor> azp) {
  const QuantRows r = check_dynamic_scaled_int8_quant(out, input, scales, azp);
  float* s = scales.data_ptr<float>();
  int32_t* zp = azp ? azp->data_ptr<int32_t>() : nullptr;
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "dynamic_scaled_int8_quant", [&] {
    for_each_row<scalar_t, int8_t>(r, input, out, [&](const scalar_t* x, int8_t* o, int64_t t) {
      if (zp == nullptr) {  // symmetric: scale = absmax / 127
        const float absmax = row_absmax(x, r.hidden);
        s[t] = absmax / 127.f;
        const float inv = absmax == 0.f ? 0.f : 127.f / absmax;
        for (int64_t i = 0; i < r.hidden; ++i) o[i] = to_int8(static_cast<float>(x[i]) * inv);
        return;
      }
      // asymmetric: [min, max] onto [-128, 127]; a constant row widens its range to hold 0
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t i = 0; i < r.hidden; ++i) {
        lo = std::fmin(lo, static_cast<float>(x[i]));
        hi = std::fmax(hi, static_cast<float>(x[i]));
      }
      if (r.hidden == 0 || lo == hi) lo = std::fmin(lo, 0.f), hi = std::fmax(hi, 0.f);
      const float scale = (hi - lo) / 255.f;
      s[t] = scale;
      if (scale == 0.f) {  // an all-zero row
        zp[t] = 0;
        for (int64_t i = 0; i < r.hidden; ++i) o[i] = 0;
        return;
      }
      const auto z = static_cast<int32_t>(std::nearbyint(-128.f - lo / scale));
      zp[t] = z;
      for (int64_t i = 0; i < r.hidden; ++i) {
        const float q = std::nearbyint(static_cast<float>(x[i]) / scale);
        o[i] = int32_to_int8(static_cast<int32_t>(q) + z);
      }
    });
  });
}

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q, at::Tensor& output_s,
                               int64_t group_size, double eps, double fp8_min, double fp8_max,
                               bool scale_ue8m0) {
  const GroupQuantShape g =
      check_per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max);
  const float lo = static_cast<float>(fp8_min), hi = static_cast<float>(fp8_max);
  const float e = static_cast<float>(eps);
  float* s = output_s.data_ptr<float>();
  PYORCH_CPU_DISPATCH_FLOATS(input.scalar_type(), "per_token_group_fp8_quant", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    Fp8* q = static_cast<Fp8*>(output_q.data_ptr());
    at::parallel_for(0, g.num_tokens * g.num_groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t t = idx / g.num_groups, grp = idx % g.num_groups;
        const scalar_t* x = in + t * g.in_stride + grp * group_size;
        Fp8* o = q + t * g.out_stride + grp * group_size;
        float scale = std::fmax(row_absmax(x, group_size), e) / hi;
        if (scale_ue8m0) scale = std::exp2(std::ceil(std::log2(scale)));
        s[t * g.s_token_stride + grp * g.s_group_stride] = scale;
        for (int64_t i = 0; i < group_size; ++i) {
          o[i] = to_fp8(static_cast<float>(x[i]) / scale, lo, hi);
        }
      }
    });
  });
}

namespace {

// [M, N] fp32 accumulators of a @ b: fp8 products summed in fp32, int8 ones in int32.
at::Tensor accumulate(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kChar) return at::_int_mm(a.contiguous(), b).to(at::kFloat);
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}

// The per-tensor / per-token / per-channel epilogue: acc * a_scale * b_scale (+ bias) -> out.
void scaled_epilogue(at::Tensor& out, const at::Tensor& acc, const ScaledMmShape& s,
                     const at::Tensor& a_scales, const at::Tensor& b_scales,
                     const std::optional<at::Tensor>& bias) {
  const at::Tensor sa =
      a_scales.numel() == 1 ? a_scales.reshape({1, 1}) : a_scales.reshape({s.m, 1});
  const at::Tensor sb =
      b_scales.numel() == 1 ? b_scales.reshape({1, 1}) : b_scales.reshape({1, s.n});
  at::Tensor d = acc * sa * sb;
  if (bias) d.add_(bias->to(at::kFloat));
  out.copy_(d);
}

}  // namespace

void cutlass_scaled_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& a_scales, const at::Tensor& b_scales,
                       const std::optional<at::Tensor>& bias) {
  const ScaledMmShape s = check_cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias);
  if (s.m == 0 || s.n == 0) return;
  if (s.scales == ScaledMmScales::kTensorOrChannel) {
    scaled_epilogue(out, accumulate(a, b), s, a_scales, b_scales, bias);
    return;
  }
  // Block-wise: each 128-deep slice of K is summed in fp32, then scaled by its activation
  // group's scale (per row) and its weight block's scale (per 128 columns).
  at::Tensor d = at::zeros({s.m, s.n}, a.options().dtype(at::kFloat));
  for (int64_t kb = 0; kb * kScaledMmBlock < s.k; ++kb) {
    const int64_t k0 = kb * kScaledMmBlock, len = std::min(kScaledMmBlock, s.k - k0);
    const at::Tensor part = accumulate(a.narrow(1, k0, len), b.narrow(0, k0, len));
    const at::Tensor sb = b_scales.select(0, kb)
                              .repeat_interleave(kScaledMmBlock)
                              .narrow(0, 0, s.n)
                              .reshape({1, s.n});
    d.add_(part * a_scales.select(1, kb).reshape({s.m, 1}) * sb);
  }
  if (bias) d.add_(bias->to(at::kFloat));
  out.copy_(d);
}

void cutlass_scaled_mm_azp(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& a_scales, const at::Tensor& b_scales,
                           const at::Tensor& azp_adj, const std::optional<at::Tensor>& azp,
                           const std::optional<at::Tensor>& bias) {
  const ScaledMmShape s =
      check_cutlass_scaled_mm_azp(out, a, b, a_scales, b_scales, azp_adj, azp, bias);
  if (s.m == 0 || s.n == 0) return;
  // acc - azp * colsum(b), in int32 as the GPU epilogue forms it, then to fp32.
  at::Tensor acc = at::_int_mm(a.contiguous(), b);
  const at::Tensor adj = azp_adj.reshape({1, s.n});
  acc = azp ? acc - azp->reshape({s.m, 1}) * adj : acc - adj;
  scaled_epilogue(out, acc.to(at::kFloat), s, a_scales, b_scales, bias);
}

namespace {

// The CPU ops that the fused quantizations compose (cpp/norm_quant.h, cpp/act_quant.h).
struct CpuComposedOps {
  static void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       double eps) {
    pyorch::cpu::rms_norm(out, input, weight, eps);
  }
  static void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                                 double eps) {
    pyorch::cpu::fused_add_rms_norm(input, residual, weight, eps);
  }
  static void dynamic_per_token_scaled_fp8_quant(at::Tensor& out, const at::Tensor& input,
                                                 at::Tensor& scales,
                                                 const std::optional<at::Tensor>& scale_ub) {
    pyorch::cpu::dynamic_per_token_scaled_fp8_quant(out, input, scales, scale_ub);
  }
  static void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
    pyorch::cpu::silu_and_mul(out, input);
  }
};

}  // namespace

void rms_norm_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,
                                      const at::Tensor& weight, at::Tensor& scale, double epsilon,
                                      const std::optional<at::Tensor>& scale_ub,
                                      std::optional<at::Tensor> residual) {
  check_rms_norm_dynamic_per_token_quant(result, input, weight, scale, scale_ub, residual);
  rms_norm_dynamic_per_token_quant_composed<CpuComposedOps>(result, input, weight, scale, epsilon,
                                                            scale_ub, residual);
}

void silu_and_mul_dynamic_per_token_quant(at::Tensor& result, const at::Tensor& input,
                                          at::Tensor& scale,
                                          const std::optional<at::Tensor>& scale_ub) {
  check_silu_and_mul_dynamic_per_token_quant(result, input, scale, scale_ub);
  silu_and_mul_dynamic_per_token_quant_composed<CpuComposedOps>(result, input, scale, scale_ub);
}

}  // namespace pyorch::cpu
