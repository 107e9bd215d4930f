// Activation quantization for the W8A8 GEMMs (vLLM's scaled_fp8_quant / scaled_int8_quant /
// per_token_group_fp8_quant). Every value is divided by its scale in fp32 (IEEE division),
// clamped to the format's range and rounded to nearest even, so CPU and CUDA agree bit for bit.
// Rows: in [num_tokens, hidden] (row stride in_stride), out [num_tokens, hidden] (out_stride);
// the last dimension is contiguous. dtype (of in): fp32, fp16 or bf16.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// The largest finite e4m3 value and the smallest dynamic scale (1 / (448 * 512)).
inline constexpr float kQuantFp8Max = 448.f;
inline constexpr float kQuantFp8MinScale = 1.f / (448.f * 512.f);

// out (fp8 e4m3 bytes) = saturate(in / scale[0]); scale: [1] fp32 on the device.
cudaError_t static_scaled_fp8_quant(void* out, const void* in, const float* scale, DType dtype,
                                    int64_t num_tokens, int64_t hidden, int64_t out_stride,
                                    int64_t in_stride, cudaStream_t stream);

// scale[0] = max(absmax(in) / 448, kQuantFp8MinScale), then the static quantization.
cudaError_t dynamic_scaled_fp8_quant(void* out, const void* in, float* scale, DType dtype,
                                     int64_t num_tokens, int64_t hidden, int64_t out_stride,
                                     int64_t in_stride, cudaStream_t stream);

// scales[t] = max(min(absmax(row t), *scale_ub) / 448, kQuantFp8MinScale) (scale_ub may be
// null); scales: [num_tokens] fp32.
cudaError_t dynamic_per_token_scaled_fp8_quant(void* out, const void* in, float* scales,
                                               const float* scale_ub, DType dtype,
                                               int64_t num_tokens, int64_t hidden,
                                               int64_t out_stride, int64_t in_stride,
                                               cudaStream_t stream);

// RMSNorm then dynamic per-token fp8 quantization of the normed row in one kernel (vLLM's
// rms_norm_dynamic_per_token_quant, fp8 out): with residual (non-null), residual += in first
// (rounded to dtype, written back) and the norm is of the sum; in itself is not written. The
// normed row is rounded to dtype as rms_norm rounds it, then quantized as
// dynamic_per_token_scaled_fp8_quant quantizes it: the same bits as those two ops (or
// fused_add_rms_norm and the quantization) on this device. weight: [hidden] of dtype; scales:
// [num_tokens] fp32; scale_ub: [1] fp32 or null. Only for rows the register-resident kernel
// takes (..._supported: 16-byte aligned rows of whole 16-byte vectors, hidden up to 16 vectors a
// thread); otherwise cudaErrorInvalidValue, and the caller runs the two ops.
bool rms_norm_dynamic_per_token_fp8_quant_supported(DType dtype, int64_t hidden, const void* out,
                                                    const void* in, const void* residual,
                                                    const void* weight, int64_t out_stride,
                                                    int64_t in_stride, int64_t residual_stride);
cudaError_t rms_norm_dynamic_per_token_fp8_quant(
    void* out, float* scales, const void* in, void* residual, const void* weight,
    const float* scale_ub, DType dtype, int64_t num_tokens, int64_t hidden, int64_t out_stride,
    int64_t in_stride, int64_t residual_stride, float eps, cudaStream_t stream);

// silu_and_mul then dynamic per-token fp8 quantization of its rows in one kernel (pyorch's
// silu_and_mul_dynamic_per_token_quant): in [num_tokens, 2 * d] (gate then up, row stride
// in_stride) -> out [num_tokens, d] e4m3 bytes (out_stride), scales [num_tokens] fp32, scale_ub
// [1] fp32 or null. silu(gate) * up is rounded to dtype as act_and_mul rounds it (the same
// expression), then quantized as dynamic_per_token_scaled_fp8_quant quantizes it: the same bits
// as those two ops on this device. Only for rows the register-resident kernel takes
// (..._supported: 16-byte aligned input rows, d a multiple of the 16-byte vector, at most 4
// vectors a thread of 1024: d <= 32768 bf16 / fp16, 16384 fp32); otherwise cudaErrorInvalidValue,
// and the caller runs the two ops.
bool silu_and_mul_dynamic_per_token_fp8_quant_supported(DType dtype, int64_t d, const void* out,
                                                        const void* in, int64_t out_stride,
                                                        int64_t in_stride);
cudaError_t silu_and_mul_dynamic_per_token_fp8_quant(void* out, float* scales, const void* in,
                                                     const float* scale_ub, DType dtype,
                                                     int64_t num_tokens, int64_t d,
                                                     int64_t out_stride, int64_t in_stride,
                                                     cudaStream_t stream);

// out (int8) = saturate(round(in / scale[0]) + azp[0]); azp: [1] int32 or null (symmetric).
cudaError_t static_scaled_int8_quant(int8_t* out, const void* in, const float* scale,
                                     const int32_t* azp, DType dtype, int64_t num_tokens,
                                     int64_t hidden, int64_t out_stride, int64_t in_stride,
                                     cudaStream_t stream);

// Per token: symmetric (azp null): scales[t] = absmax / 127, out = round(in * (127 / absmax));
// asymmetric: [min, max] (widened to hold 0 for a constant row) onto [-128, 127]:
// scales[t] = (max - min) / 255, azp[t] = round(-128 - min / scale), out = round(in / scale) + azp.
cudaError_t dynamic_scaled_int8_quant(int8_t* out, const void* in, float* scales, int32_t* azp,
                                      DType dtype, int64_t num_tokens, int64_t hidden,
                                      int64_t out_stride, int64_t in_stride, cudaStream_t stream);

// Groups of group_size along each row: s = max(absmax, eps) / fp8_max (rounded up to a power of
// two when scale_ue8m0), stored at scales[t * s_token_stride + g * s_group_stride]; out =
// clamp(in / s, fp8_min, fp8_max) as e4m3. hidden % group_size == 0.
cudaError_t per_token_group_fp8_quant(void* out, const void* in, float* scales, DType dtype,
                                      int64_t num_tokens, int64_t hidden, int64_t group_size,
                                      int64_t out_stride, int64_t in_stride, int64_t s_token_stride,
                                      int64_t s_group_stride, float eps, float fp8_min,
                                      float fp8_max, bool scale_ue8m0, cudaStream_t stream);

}  // namespace pyorch
