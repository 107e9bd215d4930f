// Gated activations of the MLP: out = act(gate) * up, with input = [gate | up].
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// The activation applied to the first half of each input row.
enum class Activation : int32_t {
  kSilu = 0,      // x * sigmoid(x)
  kGelu = 1,      // 0.5 * x * (1 + erf(x / sqrt(2)))  (exact)
  kGeluTanh = 2,  // 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
};

// out[t, i] = act(in[t, i]) * in[t, d + i] for i < d, computed in fp32 and rounded once.
//   out: [num_tokens, d]      (row stride out_stride, last dimension contiguous)
//   in:  [num_tokens, 2 * d]  (row stride in_stride, last dimension contiguous)
// dtype: fp32, fp16 or bf16 (in and out share it).
cudaError_t act_and_mul(void* out, const void* in, Activation act, DType dtype, int64_t num_tokens,
                        int64_t d, int64_t out_stride, int64_t in_stride, cudaStream_t stream);

// One-line entry points per op, named as the schemas are.
inline cudaError_t silu_and_mul(void* out, const void* in, DType dtype, int64_t num_tokens,
                                int64_t d, int64_t out_stride, int64_t in_stride,
                                cudaStream_t stream) {
  return act_and_mul(out, in, Activation::kSilu, dtype, num_tokens, d, out_stride, in_stride,
                     stream);
}
inline cudaError_t gelu_and_mul(void* out, const void* in, DType dtype, int64_t num_tokens,
                                int64_t d, int64_t out_stride, int64_t in_stride,
                                cudaStream_t stream) {
  return act_and_mul(out, in, Activation::kGelu, dtype, num_tokens, d, out_stride, in_stride,
                     stream);
}
inline cudaError_t gelu_tanh_and_mul(void* out, const void* in, DType dtype, int64_t num_tokens,
                                     int64_t d, int64_t out_stride, int64_t in_stride,
                                     cudaStream_t stream) {
  return act_and_mul(out, in, Activation::kGeluTanh, dtype, num_tokens, d, out_stride, in_stride,
                     stream);
}

}  // namespace pyorch
