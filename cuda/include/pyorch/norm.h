// RMSNorm, plain and fused with a residual add.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// out = in / sqrt(mean(in^2) + eps) * weight, row by row.
// out: [num_tokens, hidden_size] (row stride out_stride), in: [num_tokens, hidden_size] (row stride
// in_stride), weight: [hidden_size]; the last dimension of each is contiguous.
cudaError_t rms_norm(void* out, const void* in, const void* weight, DType dtype, int64_t num_tokens,
                     int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps,
                     cudaStream_t stream);

// residual += input; input = rms_norm(residual) * weight, both in place.
// input: [num_tokens, hidden_size] (row stride input_stride), residual: [num_tokens, hidden_size]
// (contiguous rows, stride residual_stride), weight: [hidden_size].
cudaError_t fused_add_rms_norm(void* input, void* residual, const void* weight, DType dtype,
                               int64_t num_tokens, int64_t hidden_size, int64_t input_stride,
                               int64_t residual_stride, float eps, cudaStream_t stream);

}  // namespace pyorch
